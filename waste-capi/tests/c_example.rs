//! The C ABI from C: `examples/hello.c` compiled against `include/waste.h`
//! and `libwaste`, run on the anchor container; its greedy tokens and
//! argmax must equal the Rust API's, its JSON must satisfy the schema, its
//! state must reload. And the header declares exactly the exported functions.

use std::path::{Path, PathBuf};
use std::process::Command;
use waste_model::{Control, GenerateParams, Model, ModelOptions};

fn anchor() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    base.join("anchor-tiny/kimi-linear-tiny.waste")
}

fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Names of `waste_*` functions exported by the crate and declared in the header.
fn names() -> (Vec<String>, Vec<String>) {
    let src = std::fs::read_to_string(here().join("src/lib.rs")).unwrap();
    let mut exported: Vec<String> = src
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("pub unsafe extern \"C\" fn ")
                .or_else(|| l.trim().strip_prefix("pub extern \"C\" fn "))
        })
        .map(|r| r.split('(').next().unwrap().to_string())
        .collect();
    let raw = std::fs::read_to_string(here().join("include/waste.h")).unwrap();
    // drop /* comments */
    let mut h = String::new();
    let mut rest = raw.as_str();
    while let Some(a) = rest.find("/*") {
        h.push_str(&rest[..a]);
        rest = rest[a..].split_once("*/").map_or("", |(_, r)| r);
    }
    h.push_str(rest);
    let mut declared: Vec<String> = Vec::new();
    for stmt in h.split(';') {
        let s = stmt.trim();
        if s.contains("typedef") || s.contains('{') || !s.contains('(') {
            continue;
        }
        let before = s.split('(').next().unwrap();
        if let Some(name) = before.split(|c: char| !(c.is_alphanumeric() || c == '_')).rfind(|w| !w.is_empty()) {
            if name.starts_with("waste_") {
                declared.push(name.to_string());
            }
        }
    }
    exported.sort();
    declared.sort();
    (exported, declared)
}

#[test]
fn the_header_declares_exactly_the_exported_functions() {
    let (exported, declared) = names();
    assert!(exported.len() >= 20, "{exported:?}");
    assert_eq!(exported, declared);
}

#[test]
fn the_c_example_runs_and_agrees_with_the_rust_api() {
    // the library built with this crate (cargo builds every crate type of the lib)
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().to_path_buf();
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let lib_dir = target.join(profile);
    assert!(
        lib_dir.join("libwaste.so").exists() || lib_dir.join("libwaste.dylib").exists(),
        "no libwaste in {}",
        lib_dir.display()
    );
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let exe = work.join("hello");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .arg(here().join("examples/hello.c"))
        .arg("-I")
        .arg(here().join("include"))
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror"])
        .arg("-L")
        .arg(&lib_dir)
        .arg("-lwaste")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("the C compiler ({cc}) is needed for the C ABI test: {e}"));
    assert!(st.success(), "hello.c did not compile");
    let prompt = "The city of Paris";
    let o = Command::new(&exe).current_dir(&work).arg(anchor()).arg(prompt).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let line = |k: &str| {
        out.lines().find_map(|l| l.strip_prefix(k)).unwrap_or_else(|| panic!("no {k:?} in {out}")).trim().to_string()
    };
    // the same through the Rust API
    let m = Model::open(anchor(), ModelOptions { ctx: 256, threads: 1, ..ModelOptions::exact() }).unwrap();
    let ids = m.encode_chat(&[waste_model::tokenizer::Message::new("user", prompt)], true).unwrap();
    let g = m
        .session()
        .generate(&ids, &GenerateParams { max_tokens: 8, ..Default::default() }, |_| Control::Continue)
        .unwrap();
    let want: Vec<String> = g.tokens.iter().map(|t| t.to_string()).collect();
    assert_eq!(line("generated"), want.join(" "));
    let mut s = m.session();
    let best = waste_model::argmax(s.eval(&ids).unwrap());
    assert_eq!(line("argmax "), format!("{best} of {}", m.config().vocab));
    assert_eq!(line("state "), "ok");
    // two sequences decoded together, each as it runs alone
    for (i, len) in [ids.len(), ids.len() - 2].into_iter().enumerate() {
        let mut s = m.session();
        let mut next = waste_model::argmax(s.eval(&ids[..len]).unwrap());
        let mut want = Vec::new();
        for _ in 0..6 {
            want.push(next.to_string());
            next = waste_model::argmax(s.eval(&[next]).unwrap());
        }
        assert_eq!(line(&format!("together {i} ")), want.join(" "), "sequence {i}");
    }
    assert_eq!(line("batch at most "), m.max_batch().to_string());
    let v: serde_json::Value = serde_json::from_str(&line("json ")).unwrap_or_else(|e| panic!("{out}: {e}"));
    assert!((1..=9).contains(&v["n"].as_i64().unwrap()) && v.as_object().unwrap().len() == 1, "{v}");
    let err = line("error ");
    assert!(!err.starts_with("0 ") && err.contains("nonexistent"), "{err}");
    assert!(line("version ").starts_with(env!("CARGO_PKG_VERSION")));
    assert!(!out.contains("templates render in"), "no helper asked for");

    // with a template helper (a script speaking the protocol): installed from C
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let helper = work.join("helper.sh");
        std::fs::write(&helper, "#!/bin/sh\ncat > /dev/null\nprintf ok\n").unwrap();
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let o = Command::new(&exe)
            .current_dir(&work)
            .env("WASTE_TEMPLATE_HELPER", &helper)
            .arg(anchor())
            .arg(prompt)
            .output()
            .unwrap();
        let out2 = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(o.status.success(), "{out2}\n{}", String::from_utf8_lossy(&o.stderr));
        assert!(out2.contains(&format!("templates render in {}", helper.display())), "{out2}");
        // not a helper: the call fails from C with the reason
        let o = Command::new(&exe)
            .current_dir(&work)
            .env("WASTE_TEMPLATE_HELPER", "/nonexistent/helper")
            .arg(anchor())
            .arg(prompt)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("waste_use_template_sandbox failed (5)"), "{err}");
    }

    // an image through the C ABI, on K3 with a vision tower (the oracle fixture, converted)
    let fx = here().join("../tools/oracle/fixtures");
    let vis = work.join("k3-vision.waste");
    let o = waste_convert::ConvertOptions {
        experts: waste_format::ExpertFmt::F16,
        trunk: waste_convert::TrunkMode::F32,
        jobs: 2,
        ..Default::default()
    };
    waste_convert::convert(&fx.join("hf-k3-vision"), &vis, &o, &|_| {}).unwrap();
    let png = fx.join("k3-vision/a.png");
    let o = Command::new(&exe).current_dir(&work).arg(&vis).arg(prompt).arg(&png).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let l = out.lines().find_map(|l| l.strip_prefix("image ")).unwrap_or_else(|| panic!("no image line in {out}"));
    let f: Vec<&str> = l.split_whitespace().collect();
    // "84x56 positions P ids N position Q": the placeholder stands for the image's P positions
    let m = Model::open(&vis, ModelOptions { ctx: 256, threads: 1, vision: true, ..ModelOptions::exact() }).unwrap();
    let want = m.image_positions(&std::fs::read(&png).unwrap()).unwrap();
    assert_eq!((f[0], f[2].parse::<usize>().unwrap()), ("84x56", want), "{l}");
    let (n, q): (usize, usize) = (f[4].parse().unwrap(), f[6].parse().unwrap());
    assert_eq!(q, n - 1 + want, "{l}");
    std::fs::remove_dir_all(&work).ok();
}
