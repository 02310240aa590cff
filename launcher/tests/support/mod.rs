//! What the supervision tests run the launcher against: stand-in children, a stand-in shard
//! Health service, and waits on events instead of sleeps.

pub mod fake_children;
pub mod fake_shard;
pub mod harness;
pub mod lines;
