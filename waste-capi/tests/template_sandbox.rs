//! `waste_use_template_sandbox`: a helper that does not render is refused
//! with a precise error; a working one is installed once per process and
//! every chat-template rendering goes through it (a test process of its
//! own: the renderer is process-wide). The helper here is a shell script
//! speaking the helper protocol, so the test shows which process rendered;
//! waste-sandbox's own tests run the real helper against hostile templates.

#![cfg(unix)]

use std::ffi::{CStr, CString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use waste::*;

fn last_error() -> String {
    // SAFETY: waste_last_error returns a valid C string.
    unsafe { CStr::from_ptr(waste_last_error()) }.to_string_lossy().into_owned()
}

fn install(p: &Path) -> waste_status {
    let c = CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a C string.
    unsafe { waste_use_template_sandbox(c.as_ptr()) }
}

/// A helper script: renders the probe `{{ 'ok' }}`; a template containing
/// MARKED is the child's own error, as a Jinja error would be.
fn script(dir: &Path) -> PathBuf {
    let p = dir.join("helper.sh");
    std::fs::write(
        &p,
        "#!/bin/sh\nreq=$(cat)\ncase \"$req\" in\n  *MARKED*) echo 'chat_template.jinja: rendered by the helper' >&2; exit 2 ;;\n  *) printf ok ;;\nesac\n",
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn a_helper_is_checked_installed_once_and_renders_every_template() {
    let dir = std::env::temp_dir().join(format!("waste-capi-sandbox-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // refused: not there, not a helper (its output is not the probe's), NULL
    assert_eq!(install(&dir.join("missing")), waste_status::WASTE_E_ARG);
    assert!(last_error().contains("not a working template helper"), "{}", last_error());
    assert_eq!(install(Path::new("/bin/true")), waste_status::WASTE_E_ARG);
    assert!(last_error().contains("not a template helper"), "{}", last_error());
    // SAFETY: NULL is a documented bad argument.
    assert_eq!(unsafe { waste_use_template_sandbox(std::ptr::null()) }, waste_status::WASTE_E_ARG);

    let helper = script(&dir);
    assert_eq!(install(&helper), waste_status::WASTE_OK, "{}", last_error());
    assert_eq!(install(&helper), waste_status::WASTE_OK, "the same helper again");
    assert_eq!(install(Path::new("/bin/true")), waste_status::WASTE_E_ARG);
    assert!(last_error().contains("already in use"), "{}", last_error());

    // a container whose template the helper marks: the error is the helper's
    let anchor = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
    let ct = dir.join("model.waste");
    std::fs::create_dir_all(&ct).unwrap();
    for e in std::fs::read_dir(&anchor).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ct.join(e.file_name())).unwrap();
    }
    std::fs::write(ct.join("chat_template.jinja"), "{# MARKED #}{% for m in messages %}{{ m.content }}{% endfor %}")
        .unwrap();
    let path = CString::new(ct.to_str().unwrap()).unwrap();
    let mut m = std::ptr::null_mut();
    // SAFETY: valid C string and out pointer; NULL options are the defaults.
    assert_eq!(unsafe { waste_open(path.as_ptr(), std::ptr::null(), &mut m) }, waste_status::WASTE_OK);
    let (role, content) = (CString::new("user").unwrap(), CString::new("hi").unwrap());
    let msg = waste_message { role: role.as_ptr(), content: content.as_ptr() };
    let mut ids = [0u32; 64];
    let mut n = 0usize;
    // SAFETY: an open model, one message, room for 64 ids.
    let st = unsafe { waste_chat_encode(m, &msg, 1, 1, ids.as_mut_ptr(), ids.len(), &mut n) };
    // the template failed on these messages (as any template error): the helper's words
    assert_eq!(st, waste_status::WASTE_E_ARG, "{}", last_error());
    assert!(last_error().contains("rendered by the helper"), "{}", last_error());
    // SAFETY: opened above, not used afterwards.
    unsafe { waste_close(m) };
    std::fs::remove_dir_all(&dir).ok();
}
