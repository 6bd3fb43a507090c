//! `waste-render-template`: the renderer child alone, for a program that
//! embeds the engine (C ABI or Rust) and wants chat templates rendered
//! outside its own process without shipping the `waste` binary. It serves
//! one request on stdin/stdout (the protocol of `waste_sandbox::render_with`)
//! and exits.

fn main() -> std::process::ExitCode {
    waste_sandbox::serve_child(std::io::stdin().lock(), std::io::stdout().lock(), std::io::stderr().lock())
}
