//! Binding workers to cores (`consort run --bind-to core`, and the ranks
//! `consort bench` starts): one core each from the launcher's own
//! affinity mask, in order, where it holds at least one per worker.
//!
//! Two ranks of one host that the scheduler put on one core take turns
//! only when a spinning wait gives the core up: about 40 us a turn for a
//! small collective on shared memory, until the scheduler moves one
//! (which ping-pong wake-ups can keep it from doing). `mpirun` binds two
//! ranks to two cores by default for that reason; torchrun binds nothing,
//! and neither does `consort run` unless asked.

/// `n` cores from this process's affinity mask, one per worker, or `None`
/// where it holds fewer (the workers then share cores and stay unbound).
pub fn cores_for(n: usize) -> Option<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set, and
    // sched_getaffinity writes at most its size; pid 0 is this process.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let got = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if got != 0 {
        return None;
    }
    let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `i` is below CPU_SETSIZE.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .take(n)
        .collect();
    (cores.len() == n && n > 0).then_some(cores)
}

/// Binds the calling process to `core` alone; for a child between fork and
/// exec (`pre_exec`), whose threads then inherit the binding.
///
/// # Safety
/// Only async-signal-safe calls are made (`sched_setaffinity` on a stack
/// value), as `pre_exec` requires; the caller runs it there or in a
/// process of its own.
pub unsafe fn bind_self_to(core: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid set; CPU_SET ignores a core past its size.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the caller; the set is valid for its size.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_come_from_this_process_mask() {
        let have = std::thread::available_parallelism().map_or(1, |n| n.get());
        let one = cores_for(1).expect("a process may run on some core");
        assert_eq!(one.len(), 1);
        if let Some(all) = cores_for(have) {
            assert_eq!(all.len(), have);
            assert!(all.windows(2).all(|w| w[0] < w[1]), "{all:?}");
        }
        assert_eq!(cores_for(have + 1), None);
        assert_eq!(cores_for(0), None);
    }

    #[test]
    fn a_child_bound_to_a_core_runs_there_alone() {
        use std::os::unix::process::CommandExt;
        let core = cores_for(1).expect("a core")[0];
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        // SAFETY: bind_self_to is async-signal-safe (see its docs).
        unsafe { cmd.pre_exec(move || bind_self_to(core)) };
        let out = cmd.output().expect("sh runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(core.to_string().as_str()),
            "{text}"
        );
    }
}
