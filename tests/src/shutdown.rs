//! A conformance body for closing: a runtime that shuts down while its
//! tasks still hold the ranks' handles drops them from its shutdown, which
//! must neither panic nor hang (a drop that waited there for its peers'
//! acknowledgements hung: the runtime no longer drives the timers and
//! sockets it would wait on).

use std::time::{Duration, Instant};

use consort_comm::ProcessGroup;

use crate::Factory;

/// Two ranks of `factory`, each held by a task that sent 4 MiB and waits
/// for ever, on a multi-thread and then a current-thread runtime, each
/// dropped while those tasks hold the handles: every drop is done within 5
/// seconds.
pub fn handles_dropped_by_a_runtime_shutting_down_close_quietly(factory: Factory) {
    let mut multi = tokio::runtime::Builder::new_multi_thread();
    multi.worker_threads(2);
    for mut builder in [multi, tokio::runtime::Builder::new_current_thread()] {
        let rt = builder.enable_all().build().expect("a runtime");
        rt.block_on(async {
            for b in factory(2).await {
                tokio::spawn(async move {
                    let pg = ProcessGroup::new(b);
                    let x = vec![1.0f32; 1 << 20];
                    let _ = pg.send(&x, 1 - pg.rank(), 0).await;
                    std::future::pending::<()>().await;
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        let t = Instant::now();
        drop(rt);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
}
