//! Writing the Prometheus text exposition format (0.0.4): HELP/TYPE headers, label sets with
//! escaped values, and sample lines.

use std::fmt::Write;

/// A metric family's header. `kind` is `counter`, `gauge`, `histogram` or `summary`.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One sample: `name{labels} value`, labels as (name, value) pairs (none: no braces).
pub fn sample(
    out: &mut String,
    name: &str,
    labels: &[(&str, &str)],
    value: impl std::fmt::Display,
) {
    out.push_str(name);
    write_labels(out, labels);
    let _ = writeln!(out, " {value}");
}

/// A header and one unlabelled sample.
pub fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, kind, help);
    sample(out, name, &[], value);
}

fn write_labels(out: &mut String, labels: &[(&str, &str)]) {
    if labels.is_empty() {
        return;
    }
    out.push('{');
    for (index, (name, value)) in labels.iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        out.push_str(name);
        out.push_str("=\"");
        out.push_str(&escape_label(value));
        out.push('"');
    }
    out.push('}');
}

/// Label values escape backslash, double quote and newline.
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// HELP text escapes backslash and newline.
fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_label_values() {
        let mut out = String::new();
        sample(&mut out, "m", &[("a", "x\"y\\z\nw"), ("b", "")], 1);
        assert_eq!(out, "m{a=\"x\\\"y\\\\z\\nw\",b=\"\"} 1\n");
    }

    #[test]
    fn unlabelled_samples_have_no_braces() {
        let mut out = String::new();
        single(&mut out, "m_total", "counter", "Things.", 3);
        assert_eq!(
            out,
            "# HELP m_total Things.\n# TYPE m_total counter\nm_total 3\n"
        );
    }
}
