//! Compiles `src/shim.cpp` (the llama.cpp entry points that can throw, wrapped so that no C++
//! exception unwinds into Rust) and `src/common_shim.cpp` (llama.cpp common's chat templates,
//! parsers, sampler and n-gram drafting behind a C interface) against the vendored headers. The operator
//! extensions of vendor patch 0005 (`ggml-ext.h`) are required.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let ext = dir.join("../vendor/llama-cpp-sys-2/llama.cpp/ggml/include/ggml-ext.h");
    println!("cargo::rerun-if-changed={}", ext.display());
    assert!(
        ext.exists(),
        "{} is missing: the operator extensions of vendor patch 0005 are required; run vendor/sync",
        ext.display()
    );
    let llama = dir.join("../vendor/llama-cpp-sys-2/llama.cpp");
    println!("cargo::rerun-if-changed=src/shim.cpp");
    println!("cargo::rerun-if-changed=src/common_shim.cpp");
    println!("cargo::rerun-if-changed=src/shim.h");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/shim.cpp")
        .file("src/common_shim.cpp")
        .include(llama.join("include"))
        .include(llama.join("ggml/include"))
        .include(llama.join("common"))
        // llama-model.h: the model's own tensor lookup (sluice_model_tensor).
        .include(llama.join("src"))
        .warnings(true)
        // common's Jinja headers define static helpers the shim does not call.
        .flag_if_supported("-Wno-unused-function")
        .compile("sluice_shim");
}
