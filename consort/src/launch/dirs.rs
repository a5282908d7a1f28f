//! The job's directory on this node (heartbeats, flight records, and the
//! workers' logs with `--log-dir`): this user's alone. A temporary one is
//! made fresh, like `mkdtemp` (a random name, mode 0700, never an existing
//! path); a `--log-dir` that exists must be a directory of this user, not a
//! symbolic link, and not writable by others.

use std::{
    hash::{BuildHasher, Hasher},
    os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use super::LaunchError;

/// The directory this node's agent writes under.
pub(super) fn run_dir(log_dir: Option<&Path>) -> Result<PathBuf, LaunchError> {
    match log_dir {
        Some(d) => checked(d),
        None => fresh(&std::env::temp_dir()),
    }
}

/// A new directory `consort-run-<pid>-<random>` under `parent`, mode 0700.
fn fresh(parent: &Path) -> Result<PathBuf, LaunchError> {
    for _ in 0..16 {
        // RandomState's keys are random per process.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let p = parent.join(format!(
            "consort-run-{}-{:016x}",
            std::process::id(),
            h.finish()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(LaunchError::Config(format!(
                    "cannot make the job's temporary directory {}: {e}; pass --log-dir",
                    p.display()
                )));
            }
        }
    }
    Err(LaunchError::Config(format!(
        "cannot make a fresh job directory in {}: every name tried exists; pass --log-dir",
        parent.display()
    )))
}

/// `--log-dir`, made (0700) if absent, refused if it is not this user's
/// own directory.
fn checked(d: &Path) -> Result<PathBuf, LaunchError> {
    match std::fs::symlink_metadata(d) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = d.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::DirBuilder::new().mode(0o700).create(d)?;
            Ok(d.to_path_buf())
        }
        Err(e) => Err(e.into()),
        Ok(m) => {
            // SAFETY: getuid has no preconditions.
            let me = unsafe { libc::getuid() };
            let why = if m.file_type().is_symlink() {
                Some("is a symbolic link".to_string())
            } else if !m.is_dir() {
                Some("is not a directory".to_string())
            } else if m.uid() != me {
                Some(format!(
                    "belongs to user {}, not to this user ({me})",
                    m.uid()
                ))
            } else if m.permissions().mode() & 0o022 != 0 {
                Some("is writable by other users".to_string())
            } else {
                None
            };
            match why {
                None => Ok(d.to_path_buf()),
                Some(why) => Err(LaunchError::Config(format!(
                    "--log-dir {} {why}: heartbeats, flight records and logs go there, so it must \
                     be a directory of this user that others cannot write; choose another",
                    d.display()
                ))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_dir_is_private_and_new_and_a_foreign_one_is_refused() {
        let base = std::env::temp_dir().join(format!("consort-dirs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let a = fresh(&base).unwrap();
        let b = fresh(&base).unwrap();
        assert_ne!(a, b);
        let mode = std::fs::metadata(&a).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // --log-dir: made when absent; a link, a file or a world-writable
        // directory is refused.
        let made = checked(&base.join("logs")).unwrap();
        assert!(made.is_dir());
        std::os::unix::fs::symlink(&a, base.join("link")).unwrap();
        std::fs::write(base.join("file"), b"").unwrap();
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        for (name, want) in [
            ("link", "symbolic link"),
            ("file", "not a directory"),
            ("open", "writable by other users"),
        ] {
            let e = checked(&base.join(name)).unwrap_err().to_string();
            assert!(e.contains(want), "{name}: {e}");
        }
        let _ = std::fs::remove_dir_all(&base);
    }
}
