//! `waste_chat_encode_think`: thinking set through the C ABI. On the anchor
//! (K3's tagged format) thinking 0 is `waste_chat_encode`'s prompt; each
//! level opens the reasoning channel after its `thinking_effort` notice;
//! a value out of range is refused.

use std::ffi::{CStr, CString};
use std::path::Path;
use waste::*;

fn last_error() -> String {
    // SAFETY: waste_last_error returns a valid C string.
    unsafe { CStr::from_ptr(waste_last_error()) }.to_string_lossy().into_owned()
}

#[test]
fn thinking_is_set_per_level_and_off_by_default() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let (role, content) = (CString::new("user").unwrap(), CString::new("What is 2+2?").unwrap());
    let msg = waste_message { role: role.as_ptr(), content: content.as_ptr() };
    // SAFETY: every pointer below is a live local or what the library returned.
    unsafe {
        let mut o = std::mem::zeroed::<waste_options>();
        waste_options_init(&mut o);
        let mut m = std::ptr::null_mut();
        assert_eq!(waste_open(path.as_ptr(), &o, &mut m), waste_status::WASTE_OK, "{}", last_error());
        let text = |think: Option<i32>| -> (waste_status, String) {
            let mut ids = vec![0u32; 4096];
            let mut n = 0usize;
            let st = match think {
                None => waste_chat_encode(m, &msg, 1, 1, ids.as_mut_ptr(), ids.len(), &mut n),
                Some(t) => waste_chat_encode_think(m, &msg, 1, 1, t, ids.as_mut_ptr(), ids.len(), &mut n),
            };
            if st != waste_status::WASTE_OK {
                return (st, last_error());
            }
            let mut buf = vec![0u8; 1 << 16];
            let mut len = 0usize;
            let d = waste_detokenize(m, ids.as_ptr(), n, buf.as_mut_ptr() as *mut _, buf.len(), &mut len);
            assert_eq!(d, waste_status::WASTE_OK, "{}", last_error());
            (st, String::from_utf8_lossy(&buf[..len]).into_owned())
        };
        let (_, off) = text(None);
        assert_eq!(text(Some(0)), (waste_status::WASTE_OK, off.clone()));
        assert!(off.ends_with("<|open|>response<|sep|>"), "{off}");
        for (t, level) in [(1, "low"), (2, "medium"), (3, "high"), (4, "max")] {
            let (st, on) = text(Some(t));
            assert_eq!(st, waste_status::WASTE_OK, "{on}");
            assert!(on.ends_with("<|open|>think<|sep|>"), "{on}");
            assert!(on.contains(&format!("`thinking_effort={level}`")), "{on}");
        }
        let (st, e) = text(Some(5));
        assert_eq!(st, waste_status::WASTE_E_ARG);
        assert!(e.contains("not 5"), "{e}");
        waste_close(m);
    }
}

/// `waste_options.fast` sits in what was the struct's tail padding (the
/// size a host compiled against the earlier header allocates is the same)
/// and selects the fast numeric mode: other logits than exact's; −1 (what
/// `waste_options_init` sets) the engine's default for this CPU.
#[test]
fn the_fast_option_keeps_the_options_size_and_changes_the_logits() {
    #[cfg(target_pointer_width = "64")]
    assert_eq!(std::mem::size_of::<waste_options>(), 48);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
    let path = CString::new(dir.to_str().unwrap()).unwrap();
    let logits = |fast: i32| -> Vec<f32> {
        // SAFETY: every pointer is a live local or what the library returned.
        unsafe {
            let mut o = std::mem::zeroed::<waste_options>();
            waste_options_init(&mut o);
            assert_eq!(o.fast, -1, "the engine's default");
            o.fast = fast;
            let mut m = std::ptr::null_mut();
            assert_eq!(waste_open(path.as_ptr(), &o, &mut m), waste_status::WASTE_OK, "{}", last_error());
            let mut s = std::ptr::null_mut();
            assert_eq!(waste_session_new(m, &mut s), waste_status::WASTE_OK);
            let ids = [305u32, 10, 20, 30];
            let (mut l, mut n) = (std::ptr::null(), 0usize);
            assert_eq!(waste_eval(s, ids.as_ptr(), ids.len(), &mut l, &mut n), waste_status::WASTE_OK);
            let v = std::slice::from_raw_parts(l, n).to_vec();
            waste_session_free(s);
            waste_close(m);
            v
        }
    };
    let (exact, fast) = (logits(0), logits(1));
    assert_eq!(exact.len(), fast.len());
    assert_ne!(exact, fast);
    // the default computes in the mode build_info names for this CPU
    let default = if ::waste_model::build_info().numeric == "fast" { &fast } else { &exact };
    assert_eq!(&logits(-1), default);
}
