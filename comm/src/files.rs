//! Files a rank writes next to others' (flight records, heartbeats,
//! checkpoints, metrics, plots): created new and never through a symbolic
//! link, so that whoever can write the directory cannot point a write of
//! ours at another file. And files we read (checkpoints, indexes): regular
//! files only, opened without blocking (a FIFO cannot hang us) and read
//! with a bound (a link to `/dev/zero` cannot exhaust memory).

use std::{
    fs::{File, OpenOptions},
    io::{self, Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

/// Reads the regular file at `path`, at most `max` bytes: anything else
/// (a FIFO, a device, a directory, a file past `max`) is an error that
/// names the path and what it is. Opening never blocks.
pub fn read_regular(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if !meta.file_type().is_file() {
        return Err(bad(format!(
            "{} is not a regular file (it is {}); give the path of a file",
            path.display(),
            kind(&meta.file_type())
        )));
    }
    if meta.len() > max {
        return Err(bad(format!(
            "{} is {} bytes, over the {max} bytes this reader accepts",
            path.display(),
            meta.len()
        )));
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(meta.len() as usize).map_err(|_| {
        bad(format!(
            "{} ({} bytes) does not fit in memory",
            path.display(),
            meta.len()
        ))
    })?;
    // A file that grows while it is read is cut at the bound.
    (&mut f)
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(bad(format!(
            "{} grew past the {max} bytes this reader accepts while it was read",
            path.display()
        )));
    }
    Ok(bytes)
}

fn kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Writes `bytes` to `path` whole, replacing whatever is there: written to
/// a new temporary file beside it, then renamed over it. A symbolic link
/// planted at `path` is replaced, never written through; a reader never
/// sees half a file.
pub fn write_replacing(path: &Path, bytes: &[u8]) -> io::Result<()> {
    with_replacing(path, |f| f.write_all(bytes))
}

/// Runs `write` on a fresh temporary file beside `path`, created new
/// (`O_EXCL | O_NOFOLLOW`) and handed over open, so nothing reopens it by
/// name (a name another writer of the directory could swap for a link in
/// the meantime); then renames it over `path`. The temporary file goes if
/// `write` fails.
pub fn with_replacing(
    path: &Path,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = temp_beside(path);
    let done = create_new(&tmp)
        .and_then(|mut f| write(&mut f).map(|()| f))
        .and_then(|f| still_ours(&f, &tmp))
        .and_then(|()| std::fs::rename(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// Whether `name` is still the file `f` was opened as: a temporary name
/// swapped for something else while it was written is not renamed into
/// place (what was written went to our file, never through the swap).
fn still_ours(f: &File, name: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let (ours, there) = (f.metadata()?, std::fs::symlink_metadata(name)?);
    if ours.dev() == there.dev() && ours.ino() == there.ino() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{} was replaced by another file while it was written; is another process writing \
         this directory?",
        name.display()
    )))
}

fn temp_beside(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // Hidden, and named after the target, so a leftover says whose it is.
    path.with_file_name(format!(".tmp-{}-{nonce}-{name}", std::process::id()))
}

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

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("consort-files-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn reads_refuse_fifos_devices_and_files_past_the_bound_without_blocking() {
        let dir = scratch("read");
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_regular(&fifo, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let zero = dir.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_regular(&zero, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a device"), "{e}");
        let e = read_regular(&dir, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let big = dir.join("big");
        std::fs::write(&big, vec![1u8; 100]).unwrap();
        let e = read_regular(&big, 99).unwrap_err();
        assert!(e.to_string().contains("over the 99 bytes"), "{e}");
        assert_eq!(read_regular(&big, 100).unwrap().len(), 100);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_temporary_file_swapped_for_a_link_is_not_written_through() {
        let dir = scratch("swap");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let target = dir.join("training.png");
        let e = with_replacing(&target, |f| {
            // Another writer of the directory swaps our temporary file for
            // a link to the victim while we write.
            let tmp = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with(".tmp-")
                })
                .unwrap();
            std::fs::remove_file(&tmp).unwrap();
            std::os::unix::fs::symlink(&victim, &tmp).unwrap();
            f.write_all(b"ours")
        })
        .unwrap_err();
        assert!(e.to_string().contains("was replaced"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(!target.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn replacing_writes_replace_a_planted_link_not_its_target() {
        let dir = scratch("replace");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = dir.join("metrics.json");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        write_replacing(&link, b"ours").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert_eq!(std::fs::read(&link).unwrap(), b"ours");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 2, "a temporary file was left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
