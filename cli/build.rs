// Compiles the pieces `plugin build` pins Python and JavaScript builds with (cli/repro/: a
// library the toolchains preload and the tracer they run under; see cli/plugin_repro.rs) with
// the build machine's C compiler, for x86_64 Linux, where the binary embeds them. They run
// beside the toolchains (glibc programs), not in this binary, so they are built for the host
// whatever the target's C library. Elsewhere `plugin build` builds those languages unpinned.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(pinned_builds)");
    for file in ["pin.c", "tracer.c", "pin.mjs"] {
        println!("cargo::rerun-if-changed=cli/repro/{file}");
    }
    let target_ok = std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64")
        && std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
    let host_ok =
        std::env::var("HOST").is_ok_and(|h| h.starts_with("x86_64-") && h.contains("linux"));
    if !(target_ok && host_ok) {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cc = std::env::var("HOST_CC").unwrap_or_else(|_| "cc".into());
    let compile = |args: &[&str], output: &str| {
        let status = Command::new(&cc)
            .args(["-O2", "-Wall", "-Wextra", "-Werror"])
            .args(args)
            .arg("-o")
            .arg(out.join(output))
            .status()
            .unwrap_or_else(|e| panic!("failed to run the C compiler {cc}: {e}"));
        assert!(
            status.success(),
            "{cc} failed to compile cli/repro for {output}"
        );
    };
    compile(&["-shared", "-fPIC", "cli/repro/pin.c", "-ldl"], "pin.so");
    compile(&["cli/repro/tracer.c"], "tracer");
    println!("cargo::rustc-cfg=pinned_builds");
}
