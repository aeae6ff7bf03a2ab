//! The profiles of `boards/`, compiled into the binary so a board needs nothing but it.

/// `(id, text)` of every profile in `boards/`, in the order `--board auto` tries them.
pub const BUILTIN: [(&str, &str); 10] = [
    ("rpi4-4gb", include_str!("../../../boards/rpi4-4gb.toml")),
    ("rpi4-8gb", include_str!("../../../boards/rpi4-8gb.toml")),
    ("rpi5-4gb", include_str!("../../../boards/rpi5-4gb.toml")),
    ("rpi5-8gb", include_str!("../../../boards/rpi5-8gb.toml")),
    ("rpi5-16gb", include_str!("../../../boards/rpi5-16gb.toml")),
    ("orin-nano-8gb", include_str!("../../../boards/orin-nano-8gb.toml")),
    ("orin-nx-16gb", include_str!("../../../boards/orin-nx-16gb.toml")),
    ("agx-orin-64gb", include_str!("../../../boards/agx-orin-64gb.toml")),
    ("generic", include_str!("../../../boards/generic.toml")),
    ("qemu-aarch64", include_str!("../../../boards/qemu-aarch64.toml")),
];

/// The built-in profile text of `id`.
pub fn text(id: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(i, _)| *i == id).map(|(_, t)| *t)
}
