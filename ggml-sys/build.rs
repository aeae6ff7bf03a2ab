//! Compiles `src/shim.cpp` (the llama.cpp entry points that can throw, wrapped so that no C++
//! exception unwinds into Rust) against the vendored headers, and detects the optional parts of
//! the patched llama.cpp that the bindings may lack: with vendor patch 0004 (the expert-ready
//! hook) applied, `cfg(expert_ready_hook)` is set; without it `--overlap` reports that it is
//! unavailable. The operator extensions of vendor patch 0005 (`ggml-ext.h`) are required.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(expert_ready_hook)");
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let header = dir.join("../vendor/llama-cpp-sys-2/llama.cpp/ggml/include/ggml-cpu.h");
    println!("cargo::rerun-if-changed={}", header.display());
    if std::fs::read_to_string(&header).is_ok_and(|t| t.contains("ggml_cpu_set_expert_ready_hook")) {
        println!("cargo::rustc-cfg=expert_ready_hook");
    }
    let ext = dir.join("../vendor/llama-cpp-sys-2/llama.cpp/ggml/include/ggml-ext.h");
    println!("cargo::rerun-if-changed={}", ext.display());
    assert!(
        ext.exists(),
        "{} is missing: the operator extensions of vendor patch 0005 are required; run vendor/sync",
        ext.display()
    );
    let llama = dir.join("../vendor/llama-cpp-sys-2/llama.cpp");
    println!("cargo::rerun-if-changed=src/shim.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/shim.cpp")
        .include(llama.join("include"))
        .include(llama.join("ggml/include"))
        .warnings(true)
        .compile("sluice_shim");
}
