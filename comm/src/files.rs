//! Files a rank writes next to others' (flight records, heartbeats,
//! checkpoints): created new and never through a symbolic link, so that
//! whoever can write the directory cannot point a write of ours at another
//! file.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::OpenOptionsExt,
    path::Path,
};

/// Creates `path` for writing: a new file (`O_EXCL`), never a symbolic
/// link's target (`O_NOFOLLOW`). A file already there (a leftover of a
/// process that died mid-write, with the same name) is unlinked first,
/// once: unlinking a link removes the link, not its target.
pub fn create_new(path: &Path) -> io::Result<File> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            open()
        }
        other => other,
    }
}

/// Opens `path` for reading and writing, creating it if absent, never
/// through a symbolic link (a file this process maps and re-creates, such
/// as the launcher's heartbeat page).
pub fn open_or_create(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_never_follow_a_planted_link() {
        let dir = std::env::temp_dir().join(format!("consort-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.join("planted");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        // open_or_create refuses the link; create_new replaces the link
        // itself with a file of ours.
        assert!(open_or_create(&link).is_err());
        use std::io::Write;
        create_new(&link).unwrap().write_all(b"ours").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert_eq!(std::fs::read(&link).unwrap(), b"ours");
        assert!(
            !std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
