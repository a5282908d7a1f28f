//! Output of every table-printing subcommand: aligned text for people, or
//! with `--json` one JSON object per row with the same fields.

use serde_json::{Map, Value};

/// A table: column names, and rows of JSON values in column order.
#[derive(Debug, Default)]
pub(crate) struct Table {
    columns: Vec<&'static str>,
    rows: Vec<Vec<Value>>,
}

impl Table {
    /// An empty table with these columns.
    pub(crate) fn new(columns: &[&'static str]) -> Self {
        Table {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; it must have one value per column.
    pub(crate) fn push(&mut self, row: Vec<Value>) {
        debug_assert_eq!(row.len(), self.columns.len());
        self.rows.push(row);
    }

    /// Renders as aligned text (`json == false`) or JSON lines.
    pub(crate) fn render(&self, json: bool) -> String {
        let mut out = String::new();
        if json {
            for row in &self.rows {
                let obj: Map<String, Value> = self
                    .columns
                    .iter()
                    .map(|c| c.to_string())
                    .zip(row.iter().cloned())
                    .collect();
                out.push_str(&Value::Object(obj).to_string());
                out.push('\n');
            }
            return out;
        }
        let cell = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Number(n) if n.is_f64() => {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.abs() >= 100.0 {
                    format!("{f:.1}")
                } else {
                    format!("{f:.3}")
                }
            }
            other => other.to_string(),
        };
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| r.iter().map(cell).collect())
            .collect();
        let widths: Vec<usize> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                cells
                    .iter()
                    .map(|r| r[i].len())
                    .chain([c.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |items: Vec<&str>| {
            items
                .iter()
                .zip(&widths)
                .map(|(s, w)| format!("{s:>w$}"))
                .collect::<Vec<_>>()
                .join("  ")
        };
        out.push_str(&line(self.columns.clone()));
        out.push('\n');
        for r in &cells {
            out.push_str(&line(r.iter().map(String::as_str).collect()));
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_and_json_carry_the_same_fields() {
        let mut t = Table::new(&["dtype", "bytes", "gbs"]);
        t.push(vec![json!("f32"), json!(1024), json!(7.25)]);
        let text = t.render(false);
        assert!(text.starts_with("dtype  bytes    gbs\n"), "{text}");
        assert!(text.contains("  f32   1024  7.250"), "{text}");
        let js = t.render(true);
        let v: Value = serde_json::from_str(js.trim()).unwrap();
        assert_eq!(v, json!({"dtype": "f32", "bytes": 1024, "gbs": 7.25}));
    }
}
