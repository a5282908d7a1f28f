//! Feeds arbitrary bytes as a sharded checkpoint's `index.json` to
//! `Sharded::load_sharded` (FSDP, one simulated rank, a real checkpoint
//! beside it). A damaged or crafted index must be refused with an error,
//! never a panic, an overflow, or a read outside the checkpoint's
//! directory; the model must still load its own good index afterwards.
#![no_main]

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex, OnceLock, mpsc},
};

use consort_comm::Backend;
use consort_ddp::{AdamW, PlainModel, ShardOptions, Sharded, Strategy};
use consort_sim::{SimConfig, SimWorld};
use libfuzzer_sys::fuzz_target;

/// The rank's thread: takes an index, answers whether loading it failed.
struct Loader {
    index: mpsc::Sender<Vec<u8>>,
    outcome: mpsc::Receiver<Result<(), String>>,
}

fn loader() -> &'static Mutex<Loader> {
    static LOADER: OnceLock<Mutex<Loader>> = OnceLock::new();
    LOADER.get_or_init(|| {
        let (index, indexes) = mpsc::channel::<Vec<u8>>();
        let (outcomes, outcome) = mpsc::channel();
        std::thread::spawn(move || serve(indexes, outcomes));
        Mutex::new(Loader { index, outcome })
    })
}

/// Saves a checkpoint once, then loads it with each index it is given.
fn serve(indexes: mpsc::Receiver<Vec<u8>>, outcomes: mpsc::Sender<Result<(), String>>) {
    let world = SimWorld::new(SimConfig::new(1)).expect("a simulated world");
    let rank: Arc<dyn Backend> = Arc::new(world.ranks().remove(0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async move {
        let mut model = PlainModel::new();
        model
            .add_param("layer.weight", vec![5, 7], &[0.5f32; 35])
            .expect("a parameter");
        model
            .add_param("layer.bias", vec![7], &[0.25f32; 7])
            .expect("a parameter");
        let o = ShardOptions::new(Strategy::Fsdp);
        let mut sh = Sharded::new(rank, &mut model, AdamW::new(0.1), o)
            .await
            .expect("a sharded model");
        let dir: PathBuf =
            std::env::temp_dir().join(format!("consort-fuzz-index-{}", std::process::id()));
        sh.save_sharded(&dir, &BTreeMap::new())
            .await
            .expect("a checkpoint");
        let good = std::fs::read(dir.join("index.json")).expect("its index");
        while let Ok(bytes) = indexes.recv() {
            std::fs::write(dir.join("index.json"), &bytes).expect("writing the index");
            let crafted = sh.load_sharded(&dir).await.map(|_| ());
            std::fs::write(dir.join("index.json"), &good).expect("writing the index");
            let again = sh.load_sharded(&dir).await.map(|_| ());
            let out = match again {
                Ok(()) => crafted.map_err(|e| e.to_string()),
                Err(e) => panic!("the good index no longer loads after a crafted one: {e}"),
            };
            if outcomes.send(out).is_err() {
                return;
            }
        }
    });
}

fuzz_target!(|data: &[u8]| {
    let l = loader().lock().unwrap_or_else(|p| p.into_inner());
    l.index.send(data.to_vec()).expect("the loader is alive");
    let _ = l
        .outcome
        .recv()
        .expect("the loader answered (it panicked otherwise)");
});
