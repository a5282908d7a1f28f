//! `consort store`: a standalone TCPStore (PyTorch wire-compatible) until
//! interrupted, with the same limits and optional secret as the stores
//! consort starts itself.

use consort::TcpStoreServer;
use consort_tcp::{Secret, ServerOptions, store::parse_bytes};

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
    /// Shared secret every client must prove (default: CONSORT_SECRET).
    /// torch's own clients cannot: leave it unset when torch connects.
    #[arg(long)]
    secret: Option<String>,
    /// The most bytes the store holds or owes (keys and values, requests
    /// being read, replies not yet sent), with a K, M, G or T suffix
    /// (default: CONSORT_STORE_MAX_BYTES, else 1G).
    #[arg(long)]
    max_bytes: Option<String>,
    /// The most clients connected at once (default:
    /// CONSORT_STORE_MAX_CLIENTS, else 16384).
    #[arg(long)]
    max_clients: Option<usize>,
}

/// The server's options: the environment's, then the flags over them.
fn options(a: &StoreArgs) -> Result<ServerOptions, BoxError> {
    let mut o = ServerOptions::from_env()?;
    if let Some(s) = &a.secret {
        o.secret = Some(Secret::new(s.as_bytes()).ok_or("--secret must not be empty")?);
    }
    if let Some(b) = &a.max_bytes {
        o.max_bytes = parse_bytes(b).ok_or_else(|| {
            format!("--max-bytes {b:?}: expected a number of bytes with an optional K, M, G or T suffix, such as 4G")
        })?;
    }
    if let Some(n) = a.max_clients {
        if n == 0 {
            return Err("--max-clients must be at least 1".into());
        }
        o.max_clients = n;
    }
    Ok(o)
}

/// Runs the store until Ctrl-C.
pub(crate) async fn run(a: StoreArgs) -> Result<(), BoxError> {
    let opts = options(&a)?;
    let secured = opts.secret.is_some();
    let server = TcpStoreServer::bind_opts(format!("{}:{}", a.host, a.port).as_str(), opts).await?;
    println!("TCPStore listening on {}", server.local_addr());
    if !secured && a.host != "127.0.0.1" && a.host != "localhost" && a.host != "::1" {
        eprintln!(
            "warning: this store has no secret and listens on {}: anyone who can reach it can \
             read and rewrite a job's rendezvous. Set --secret (or CONSORT_SECRET) when every \
             client is consort",
            a.host
        );
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
