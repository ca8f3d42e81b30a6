//! A top-level JSON object seen as a list of members whose values are byte ranges of the
//! original text, so that fields can be replaced, removed or added by splicing bytes instead
//! of re-serializing the document (numbers, escapes and key order survive untouched).

use std::ops::Range;

use crate::json_scan::{scan_object, JsonError};

/// One `"key": value` member of the top-level object.
pub use crate::json_scan::ScannedMember as Member;

/// A validated JSON document whose top level is an object.
#[derive(Debug)]
pub struct TopLevelObject<'a> {
    text: &'a [u8],
    open_brace: usize,
    close_brace: usize,
    members: Vec<Member<'a>>,
}

/// What to do with a member when splicing.
#[derive(Debug, Clone, Copy)]
pub enum Edit<'r> {
    Keep,
    Replace(&'r [u8]),
    Remove,
}

impl<'a> TopLevelObject<'a> {
    /// Validates the whole document (grammar, UTF-8) and indexes its top-level members.
    pub fn parse(text: &'a [u8]) -> Result<Self, JsonError> {
        let scanned = scan_object(text)?;
        Ok(TopLevelObject {
            text,
            open_brace: scanned.open_brace,
            close_brace: scanned.close_brace,
            members: scanned.members,
        })
    }

    pub fn members(&self) -> &[Member<'a>] {
        &self.members
    }

    pub fn has(&self, key: &str) -> bool {
        self.members.iter().any(|m| m.key == key)
    }

    /// The value text of the last member named `key` (the one JSON parsers keep).
    pub fn last_value(&self, key: &str) -> Option<&'a [u8]> {
        self.members
            .iter()
            .rev()
            .find(|m| m.key == key)
            .and_then(|m| self.text.get(m.value.clone()))
    }

    /// Byte offset of the closing brace, where appended members go.
    pub fn close_brace(&self) -> usize {
        self.close_brace
    }

    /// Writes the document with each member edited as `edit` says and `append`ed members
    /// added before the closing brace. Whitespace and separators of kept members stay as
    /// they were.
    pub fn splice<'r>(
        &self,
        mut edit: impl FnMut(&str) -> Edit<'r>,
        append: &[(&str, &[u8])],
    ) -> Vec<u8> {
        let bytes = self.text;
        let extra: usize = append.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        let mut out = Vec::with_capacity(bytes.len() + extra + 16);
        let after_open = self.open_brace + 1;
        out.extend_from_slice(span(bytes, 0..after_open));

        let mut cursor = after_open;
        let mut emitted_any = false;
        for member in &self.members {
            let value = match edit(&member.key) {
                Edit::Remove => {
                    cursor = member.value.end;
                    continue;
                }
                Edit::Keep => span(bytes, member.value.clone()),
                Edit::Replace(replacement) => replacement,
            };
            let mut lead = span(bytes, cursor..member.value.start);
            if !emitted_any && cursor != after_open {
                // Members before this one were removed: its leading comma has nothing
                // to separate any more.
                if let Some(comma) = lead.iter().position(|&b| b == b',') {
                    lead = lead.get(comma + 1..).unwrap_or_default();
                }
            }
            out.extend_from_slice(lead);
            out.extend_from_slice(value);
            cursor = member.value.end;
            emitted_any = true;
        }

        out.extend_from_slice(span(bytes, cursor..self.close_brace));
        for (key, value) in append {
            if emitted_any {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(value);
            emitted_any = true;
        }
        out.extend_from_slice(span(bytes, self.close_brace..bytes.len()));
        out
    }
}

/// The bytes of a range the parser produced (always in bounds).
fn span(bytes: &[u8], range: Range<usize>) -> &[u8] {
    bytes.get(range).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splice_str(
        text: &str,
        edit: impl FnMut(&str) -> Edit<'static>,
        append: &[(&str, &[u8])],
    ) -> String {
        let object = TopLevelObject::parse(text.as_bytes()).unwrap();
        String::from_utf8(object.splice(edit, append)).unwrap()
    }

    #[test]
    fn indexes_members_with_exact_value_text() {
        let text = r#" { "a" : 1.50 , "b\u0022": {"x": [1,2]}, "c":"\u00e9" } "#;
        let object = TopLevelObject::parse(text.as_bytes()).unwrap();
        let found: Vec<(&str, &str)> = object
            .members()
            .iter()
            .map(|m| (m.key.as_ref(), &text[m.value.clone()]))
            .collect();
        assert_eq!(
            found,
            vec![
                ("a", "1.50"),
                ("b\"", r#"{"x": [1,2]}"#),
                ("c", r#""\u00e9""#)
            ]
        );
    }

    #[test]
    fn rejects_what_is_not_an_object() {
        for text in ["", "[]", "1", "\"s\"", "{", "{}x", "{\"a\":}", "null"] {
            assert!(TopLevelObject::parse(text.as_bytes()).is_err(), "{text:?}");
        }
    }

    #[test]
    fn deep_nesting_inside_a_value_does_not_overflow_the_stack() {
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(50_000), "]".repeat(50_000));
        let object = TopLevelObject::parse(deep.as_bytes()).unwrap();
        assert_eq!(object.members()[0].value.len(), 100_000);
        let unbalanced = format!("{{\"a\":{}}}", "[".repeat(50_000));
        assert!(TopLevelObject::parse(unbalanced.as_bytes()).is_err());
    }

    #[test]
    fn keep_everything_is_identity() {
        let text = "{ \"a\" :1 ,\n \"b\":[ 2 ] }\n";
        assert_eq!(splice_str(text, |_| Edit::Keep, &[]), text);
    }

    #[test]
    fn removes_first_middle_and_last_members() {
        let text = r#"{"a":1, "b":2, "c":3, "d":4}"#;
        let drop = |keys: &'static [&'static str]| {
            move |k: &str| {
                if keys.contains(&k) {
                    Edit::Remove
                } else {
                    Edit::Keep
                }
            }
        };
        assert_eq!(
            splice_str(text, drop(&["a"]), &[]),
            r#"{ "b":2, "c":3, "d":4}"#
        );
        assert_eq!(
            splice_str(text, drop(&["a", "b"]), &[]),
            r#"{ "c":3, "d":4}"#
        );
        assert_eq!(
            splice_str(text, drop(&["b", "c"]), &[]),
            r#"{"a":1, "d":4}"#
        );
        assert_eq!(
            splice_str(text, drop(&["d"]), &[]),
            r#"{"a":1, "b":2, "c":3}"#
        );
        assert_eq!(splice_str(text, drop(&["a", "b", "c", "d"]), &[]), "{}");
    }

    #[test]
    fn replaces_and_appends() {
        let text = r#"{"a":1,"b":"x"}"#;
        let out = splice_str(
            text,
            |k| {
                if k == "b" {
                    Edit::Replace(b"false")
                } else {
                    Edit::Keep
                }
            },
            &[("c", b"1"), ("d", b"{}")],
        );
        assert_eq!(out, r#"{"a":1,"b":false,"c":1,"d":{}}"#);
    }

    #[test]
    fn appends_into_empty_and_emptied_objects() {
        assert_eq!(
            splice_str(" {} ", |_| Edit::Keep, &[("k", b"1")]),
            r#" {"k":1} "#
        );
        assert_eq!(
            splice_str(r#"{"x":0}"#, |_| Edit::Remove, &[("k", b"1"), ("j", b"2")]),
            r#"{"k":1,"j":2}"#
        );
    }
}
