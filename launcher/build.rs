// Generates the shard client (and, for tests, the server) from proto/ at build time; the generated code is never committed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc, so a fresh machine needs nothing beyond cargo.
    if std::env::var_os("PROTOC").is_none() {
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    tonic_prost_build::configure()
        .build_client(true)
        // The server side only exists for tests, which serve a fake shard's Health.
        .build_server(true)
        .server_mod_attribute("quiver.v1", "#[cfg(test)]")
        .compile_protos(&["../proto/quiver/v1/shard.proto"], &["../proto"])?;
    println!("cargo:rerun-if-changed=../proto/quiver/v1/shard.proto");
    Ok(())
}
