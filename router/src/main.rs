use clap::Parser;
use quiver_router::config::RouterArgs;

fn main() {
    let args = RouterArgs::parse();
    println!("{args:?}");
}
