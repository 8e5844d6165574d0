fn main() {
    println!("cargo:rerun-if-changed=src/emu.cpp");
    println!("cargo:rerun-if-changed=src/emu.h");
    println!("cargo:rerun-if-changed=shim");
    println!("cargo:rerun-if-changed=../kernels");
    cc::Build::new()
        .cpp(true)
        .file("src/emu.cpp")
        .include("shim")
        .std("c++20")
        // The kernels round every operation on its own: no contraction.
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag("-pthread")
        .flag_if_supported("-Wno-unknown-pragmas")
        .opt_level(2)
        .compile("zq_emu");
    println!("cargo:rustc-link-lib=stdc++");
}
