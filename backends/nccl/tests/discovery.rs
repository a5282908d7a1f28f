//! Finding NCCL as PyTorch users have it: the lone `libnccl.so.2` of the
//! `nvidia-nccl-cu12` wheel. Loading it needs no GPU (`ncclGetVersion`
//! runs anywhere), so these run wherever a wheel can be found:
//!
//! - `CONSORT_NCCL_WHEEL_DIR=/path/to/site-packages/nvidia/nccl/lib`, or
//! - `CONSORT_TORCH_PYTHON=/path/to/python` with torch (its CUDA wheels
//!   depend on `nvidia-nccl-cu12`).
//!
//! Without either they print why they skip. Each case runs in a child
//! process (this test binary again) so that the environment it is given is
//! the whole environment NCCL discovery sees.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The child: load NCCL the way `NcclBackend::new` does and report.
#[test]
fn discovery_child() {
    if std::env::var_os("CONSORT_DISCOVERY_CHILD").is_none() {
        return;
    }
    println!("CANDIDATES {}", consort_nccl::sys::candidates().join(" "));
    match consort_nccl::sys::load() {
        Ok(n) => println!("LOADED {} FROM {}", n.version_string(), n.path),
        Err(e) => println!("MISSED {e}"),
    }
}

fn wheel_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CONSORT_NCCL_WHEEL_DIR") {
        return Some(PathBuf::from(d));
    }
    let python = std::env::var_os("CONSORT_TORCH_PYTHON")?;
    let out = Command::new(python)
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    dir.join("libnccl.so.2").exists().then_some(dir)
}

/// Runs the child with exactly these discovery variables.
fn child(vars: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["discovery_child", "--exact", "--nocapture"])
        .env("CONSORT_DISCOVERY_CHILD", "1")
        .env_remove("CONSORT_NCCL_LIBRARY")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX")
        .env("LD_LIBRARY_PATH", "");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the child");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn loaded_from(out: &str, dir: &Path) -> bool {
    let lib = dir.join("libnccl.so.2");
    let real = std::fs::canonicalize(&lib).unwrap_or(lib);
    out.lines().any(|l| {
        l.starts_with("LOADED 2.")
            && l.split(" FROM ")
                .nth(1)
                .is_some_and(|p| std::fs::canonicalize(p.trim()).is_ok_and(|p| p == real))
    })
}

#[test]
fn nccl_loads_from_the_pip_wheel_and_an_active_environment_comes_first() {
    let Some(dir) = wheel_dir() else {
        eprintln!(
            "skipped: no nvidia-nccl-cu12 wheel found (set CONSORT_NCCL_WHEEL_DIR, or \
             CONSORT_TORCH_PYTHON to a python with CUDA torch)"
        );
        return;
    };
    let d = dir.display().to_string();
    // 1. Only the wheel's lib directory on LD_LIBRARY_PATH.
    let out = child(&[("LD_LIBRARY_PATH", &d)]);
    assert!(loaded_from(&out, &dir), "LD_LIBRARY_PATH={d}: {out}");
    // 2. An explicit path.
    let lib = dir.join("libnccl.so.2").display().to_string();
    let out = child(&[("CONSORT_NCCL_LIBRARY", &lib)]);
    assert!(loaded_from(&out, &dir), "CONSORT_NCCL_LIBRARY={lib}: {out}");
    // 3. An active virtual environment whose site-packages hold the wheel
    //    (a scratch venv layout linking to it).
    let venv = std::env::temp_dir().join(format!("consort-venv-{}", std::process::id()));
    let site = venv.join("lib/python3.11/site-packages/nvidia/nccl");
    std::fs::create_dir_all(&site).unwrap();
    let link = site.join("lib");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let out = child(&[("VIRTUAL_ENV", &venv.display().to_string())]);
    assert!(loaded_from(&out, &dir), "VIRTUAL_ENV: {out}");
    // 4. The environment's wheel wins over a library on the loader's path
    //    (a system NCCL there would be another version than torch's): the
    //    path loaded is the venv's, not the LD_LIBRARY_PATH one.
    let out = child(&[
        ("VIRTUAL_ENV", &venv.display().to_string()),
        ("LD_LIBRARY_PATH", &d),
    ]);
    let _ = std::fs::remove_dir_all(&venv);
    let tried: Vec<&str> = out
        .lines()
        .find_map(|l| l.strip_prefix("CANDIDATES "))
        .unwrap_or("")
        .split(' ')
        .collect();
    let venv_at = tried
        .iter()
        .position(|c| c.starts_with(&venv.display().to_string()));
    let system_at = tried.iter().position(|c| *c == "libnccl.so.2");
    assert!(
        matches!((venv_at, system_at), (Some(v), Some(s)) if v < s),
        "the venv's wheel must come before the loader's path: {tried:?}"
    );
    assert!(loaded_from(&out, &dir), "{out}");
}

#[test]
fn a_miss_lists_every_name_and_path_tried() {
    let out = child(&[("CONSORT_NCCL_LIBRARY", "/nowhere/libnccl.so.2")]);
    if out.contains("LOADED") {
        // A system NCCL: the explicit path failed, so the search went on.
        eprintln!("this machine has a system NCCL: {out}");
        return;
    }
    assert!(out.contains("MISSED"), "{out}");
    for name in ["/nowhere/libnccl.so.2", "libnccl.so.2", "libnccl.so"] {
        assert!(
            out.contains(&format!("{name} (")),
            "{name} missing from: {out}"
        );
    }
}
