//! The helper binary against the in-process renderer and hostile
//! templates: the same markup for a real template; an error naming the
//! file — and this process alive — for templates that would exhaust
//! memory, run past the CPU limit's work or write past the output bound.

use std::path::Path;
use waste_sandbox::render_with;
use waste_tokenizer::{render_jinja, TEMPLATE_OUTPUT_BYTES};

fn helper() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_waste-render-template"))
}

const KIMI_LIKE: &str =
    "{%- for m in messages -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>\
{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}";

#[test]
fn a_real_template_renders_as_in_process() {
    let roles = ["system", "user", "assistant", "user"];
    for open in [false, true] {
        let want = render_jinja(KIMI_LIKE, &roles, open).unwrap();
        assert_eq!(render_with(helper(), KIMI_LIKE, &roles, open).unwrap(), want);
    }
    // a Jinja error is the child's own message, as in process
    let want = render_jinja("{% for %}", &roles, true).unwrap_err().to_string();
    let got = render_with(helper(), "{% for %}", &roles, true).unwrap_err().to_string();
    assert_eq!(got, want);
}

#[test]
fn hostile_templates_are_errors_and_this_process_goes_on() {
    for hostile in [
        // a string doubled 40 times (a terabyte): the child's address space ends it
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% macro f(s, n) %}{% if n < 30 %}{{ f(s ~ s, n + 1) }}{% endif %}{% endmacro %}{{ f('xxxxxxxxxxxxxxxx', 0) }}",
        // 100 MB repetitions: one instruction each, past the output bound
        "{% for i in range(100) %}{{ 'x' * 100000000 }}{% endfor %}",
        // fuel
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}",
    ] {
        let e = render_with(helper(), hostile, &["user"], true).unwrap_err().to_string();
        assert!(e.contains("chat_template.jinja"), "{hostile}: {e}");
    }
    // exactly the bound renders; one byte more does not
    let exact = format!("{{{{ 'x' * {TEMPLATE_OUTPUT_BYTES} }}}}");
    assert_eq!(render_with(helper(), &exact, &["user"], true).unwrap().len(), TEMPLATE_OUTPUT_BYTES);
    let over = format!("{{{{ 'x' * {} }}}}", TEMPLATE_OUTPUT_BYTES + 1);
    let e = render_with(helper(), &over, &["user"], true).unwrap_err().to_string();
    assert!(e.contains("chat_template.jinja"), "{e}");
    // and the next rendering works
    assert!(render_with(helper(), KIMI_LIKE, &["user"], true).is_ok());
}
