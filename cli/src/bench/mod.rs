//! `warren bench`: load generators and measurements.

pub mod conns;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Many idle MQTT connections: broker memory per connection, connects per second,
    /// keep-alive CPU and publish -> deliver latency while they are held.
    Conns(conns::ConnsArgs),
}

pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Conns(args) => conns::run(args).await,
    }
}
