//! `consort store`: a standalone TCPStore (PyTorch wire-compatible) until
//! interrupted.

use consort::TcpStoreServer;

type BoxError = Box<dyn std::error::Error>;

/// `consort store`'s flags.
#[derive(Debug, clap::Args)]
pub(crate) struct StoreArgs {
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 29500)]
    port: u16,
}

/// Runs the store until Ctrl-C.
pub(crate) async fn run(a: StoreArgs) -> Result<(), BoxError> {
    let server = TcpStoreServer::bind(format!("{}:{}", a.host, a.port).as_str()).await?;
    println!("TCPStore listening on {}", server.local_addr());
    use std::io::Write;
    std::io::stdout().flush()?;
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
