//! Flame graph SVG (inferno) over any subset of a profile's samples.

use crate::model::{Frame, ProfileData, Sample};
use inferno::flamegraph::{self, Options};
use std::collections::HashMap;

/// Characters XML 1.0 forbids (a NUL would make the browser reject the whole SVG).
fn xml_safe(text: &str) -> String {
    text.chars()
        .map(|c| if (c < ' ' && c != '\t') || c == '\u{FFFE}' || c == '\u{FFFF}' { '\u{FFFD}' } else { c })
        .collect()
}

/// `name (file.py:12)`, with the characters that delimit folded stacks replaced.
fn label(f: &Frame) -> String {
    let file = f.file.rsplit('/').next().unwrap_or(&f.file);
    let text = if f.line > 0 { format!("{} ({}:{})", f.name, file, f.line) } else { format!("{} ({})", f.name, file) };
    xml_safe(&text.replace([';', '\n', '\r'], " "))
}

/// Folded stacks (`root;...;leaf microseconds`), one line per distinct stack.
pub fn folded(data: &ProfileData, keep: &dyn Fn(&Sample) -> bool) -> Vec<String> {
    let mut weights: HashMap<u32, u64> = HashMap::new();
    for s in data.samples.iter().filter(|s| keep(s)) {
        *weights.entry(s.stack).or_default() += s.weight_us as u64;
    }
    let labels: Vec<String> = data.frames.iter().map(label).collect();
    let mut lines: Vec<String> = weights
        .into_iter()
        .filter(|&(_, w)| w > 0)
        .map(|(stack, w)| {
            let names: Vec<&str> = data.stacks[stack as usize].iter().map(|&f| labels[f as usize].as_str()).collect();
            format!("{} {}", names.join(";"), w)
        })
        .collect();
    lines.sort();
    lines
}

/// inferno's script records zoom and search in the page URL; a graph embedded in a
/// report's frame has an opaque origin where that throws, so it is switched off.
const EMBED_SHIM: &str = "<script type=\"text/ecmascript\"><![CDATA[history.replaceState = function () {};]]></script>";

/// An interactive SVG (click to zoom, search); None when no sample matches.
pub fn svg(data: &ProfileData, title: &str, keep: &dyn Fn(&Sample) -> bool) -> Option<String> {
    let lines = folded(data, keep);
    if lines.is_empty() {
        return None;
    }
    let mut opts = Options::default();
    opts.title = xml_safe(title);
    opts.count_name = "μs".into();
    opts.deterministic = true;
    let mut out = Vec::new();
    flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut out).ok()?;
    let svg = String::from_utf8(out).ok()?;
    Some(svg.replacen("<script", &format!("{EMBED_SHIM}<script"), 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::profile;

    #[test]
    fn folds_and_renders() {
        let mut data = profile("w", &[(1, &["main", "f"], None), (1, &["main", "f"], None), (1, &["main", "g;x"], None)]);
        data.frames[0].name = "<script>alert(1)</script>".into();
        let lines = folded(&data, &|_| true);
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().any(|l| l.ends_with("(f.py:1) 20000")));
        assert!(lines.iter().any(|l| l.ends_with(";g x (g x.py:1) 10000")), "{lines:?}");
        let svg = svg(&data, "t", &|_| true).unwrap();
        assert!(svg.starts_with("<?xml"));
        assert!(!svg.contains("<script>alert(1)"), "names are escaped");
        assert!(svg.contains("&lt;script&gt;alert(1)"));
        assert!(super::svg(&data, "t", &|_| false).is_none());
    }
}
