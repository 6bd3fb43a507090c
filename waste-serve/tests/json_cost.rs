//! `json_parse_bytes` bounds what parsing a body into a `serde_json::Value`
//! takes: checked with a counting allocator on the shapes that cost the most
//! per byte, and on ordinary chat requests (one test: the counters are
//! process-wide).

#[path = "../../tests-support/counting_alloc.rs"]
mod counting;
use counting::peak_during;

/// `[unit,unit,…]` of about `n` bytes.
fn repeated(unit: &str, n: usize) -> String {
    let mut s = String::from("[");
    while s.len() + unit.len() + 1 < n {
        s.push_str(unit);
        s.push(',');
    }
    s.pop();
    s.push(']');
    s
}

#[test]
fn the_scan_bounds_what_parsing_takes() {
    let n = 1 << 20;
    let chat = serde_json::json!({"messages": (0..2000).map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
        "content": format!("message {i}: {}", "words ".repeat(i % 50))})).collect::<Vec<_>>(), "max_tokens": 16})
    .to_string();
    let cases: Vec<(&str, String)> = vec![
        ("nested arrays", repeated("[[[]]]", n)),
        ("one-entry objects", repeated("{\"\":0}", n)),
        ("numbers", repeated("0", n)),
        ("empty strings", repeated("\"\"", n)),
        ("empty objects", repeated("{}", n)),
        ("escapes", repeated("\"\\u0041\\\"\"", n)),
        (
            "twelve-key objects",
            repeated(&format!("{{{}}}", (0..12).map(|k| format!("\"{k}\":{k}")).collect::<Vec<_>>().join(",")), n),
        ),
        ("a chat", chat),
    ];
    for (what, body) in &cases {
        let bound = waste_serve::json_parse_bytes(body.as_bytes());
        let (peak, v) = peak_during(|| serde_json::from_slice::<serde_json::Value>(body.as_bytes()).unwrap());
        let peak = peak as u64 + body.len() as u64; // the body is held beside it
        drop(v);
        println!(
            "{what:>20}: {} bytes, parsing peaked at {peak}, bound {bound} ({:.2})",
            body.len(),
            peak as f64 / bound as f64
        );
        assert!(peak <= bound, "{what}: parsing {} bytes peaked at {peak}, over the bound {bound}", body.len());
        assert!(bound <= 4 * peak, "{what}: the bound {bound} is over 4× the peak {peak}");
    }
}
