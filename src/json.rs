//! JSON as the filter needs it: a single-pass validator that indexes the members of a
//! top-level object, and splicing of those members by byte ranges, so that fields can be
//! replaced, removed or added without re-serializing the document (numbers, escapes and key
//! order survive untouched).
//!
//! One pass does what `std::str::from_utf8` plus serde_json did in two: every byte is
//! checked (grammar, and UTF-8 inside strings, the only place JSON allows non-ASCII), and the
//! body of a long string, usually the prompt, is taken 64 bytes at a time with SIMD
//! (wasm `simd128` when the build enables it, SSE2 on x86-64; bytewise elsewhere): one
//! mask of the bytes that need a look, and only those are looked at. Nesting is tracked on a
//! heap stack, so no input can overflow the call stack.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

/// Why a document is not a valid JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    pub kind: JsonErrorKind,
    /// Byte offset where the problem was found.
    pub offset: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonErrorKind {
    /// A string holds bytes that are not UTF-8.
    InvalidUtf8,
    /// The document is not JSON, or not an object; the text says what was expected.
    Syntax(&'static str),
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.kind {
            JsonErrorKind::InvalidUtf8 => write!(f, "invalid UTF-8 at byte {}", self.offset),
            JsonErrorKind::Syntax(what) => write!(f, "{what} at byte {}", self.offset),
        }
    }
}

/// A member of the top-level object.
#[derive(Debug)]
pub struct Member<'a> {
    /// The key with JSON escapes resolved.
    pub key: Cow<'a, str>,
    /// Where the value's text lies in the document.
    pub value: Range<usize>,
}

// How many times a member's key was compared with another key (by the lookups and the
// splice plans here): the tests bound the work a document can cause with it.
#[cfg(test)]
thread_local! {
    static KEY_COMPARISONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The key comparisons made on this thread so far (tests only).
#[cfg(test)]
pub(crate) fn key_comparisons() -> usize {
    KEY_COMPARISONS.with(std::cell::Cell::get)
}

/// Whether a member's key is `key`.
fn same_key(member: &str, key: &str) -> bool {
    #[cfg(test)]
    KEY_COMPARISONS.with(|count| count.set(count.get() + 1));
    member == key
}

/// Two keys in order, for sorting and searching them.
fn compare_keys(a: &str, b: &str) -> std::cmp::Ordering {
    #[cfg(test)]
    KEY_COMPARISONS.with(|count| count.set(count.get() + 1));
    a.cmp(b)
}

/// Keys of an object, sorted once so that each look is a binary search: a test for each of
/// an object's many members costs `n log n` key comparisons, not `n * n`.
#[derive(Debug)]
pub struct KeySet<'a> {
    sorted: Vec<&'a str>,
}

impl KeySet<'_> {
    pub fn contains(&self, key: &str) -> bool {
        self.sorted
            .binary_search_by(|probe| compare_keys(probe, key))
            .is_ok()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
}

/// A validated JSON document whose top level is an object, seen as a list of members whose
/// values are byte ranges of the original text.
#[derive(Debug)]
pub struct JsonObject<'a> {
    text: &'a [u8],
    open_brace: usize,
    close_brace: usize,
    members: Vec<Member<'a>>,
    longest_integer: usize,
    deepest: usize,
}

/// Validates `bytes` as a JSON document whose top level is an object and indexes its members.
fn scan_object(bytes: &[u8]) -> Result<JsonObject<'_>, JsonError> {
    let mut scanner = Scanner {
        bytes,
        pos: 0,
        longest_integer: 0,
        deepest: 0,
    };
    // Enough for an answer's or a usage object's members without growing.
    let mut members = Vec::with_capacity(12);
    let open_brace = scanner.container(b'{', "expected a JSON object", |scanner| {
        let key = scanner.key()?;
        scanner.skip_whitespace();
        let start = scanner.pos;
        scanner.value()?;
        members.push(Member {
            key,
            value: start..scanner.pos,
        });
        Ok(())
    })?;
    let close_brace = scanner.pos - 1;
    if !scanner.at_end() {
        return Err(scanner.error("trailing characters after the object"));
    }
    Ok(JsonObject {
        text: bytes,
        open_brace,
        close_brace,
        members,
        longest_integer: scanner.longest_integer,
        deepest: scanner.deepest + 1,
    })
}

impl<'a> JsonObject<'a> {
    /// Validates the whole document (grammar, UTF-8) and indexes its top-level members.
    pub fn parse(text: &'a [u8]) -> Result<Self, JsonError> {
        scan_object(text)
    }

    /// The document the object was parsed from.
    pub fn text(&self) -> &'a [u8] {
        self.text
    }

    pub fn members(&self) -> &[Member<'a>] {
        &self.members
    }

    /// The digits of the longest integer literal (no fraction, no exponent) anywhere in the
    /// document, at any depth; 0 when it has none.
    pub fn longest_integer(&self) -> usize {
        self.longest_integer
    }

    /// How many objects and arrays deep the document goes, its own top-level object
    /// counted: 1 for `{}`, 2 for `{"a":[]}`.
    pub fn depth(&self) -> usize {
        self.deepest
    }

    pub fn has(&self, key: &str) -> bool {
        self.members.iter().any(|m| same_key(&m.key, key))
    }

    /// The value text of every member named `key`, in order: the ones JSON parsers drop
    /// too.
    pub fn values<'k>(&'k self, key: &'k str) -> impl Iterator<Item = &'a [u8]> + 'k {
        self.members
            .iter()
            .filter(move |m| same_key(&m.key, key))
            .filter_map(|m| self.text.get(m.value.clone()))
    }

    /// The value text of the last member named `key` (the one JSON parsers keep).
    pub fn last_value(&self, key: &str) -> Option<&'a [u8]> {
        self.members
            .iter()
            .rev()
            .find(|m| same_key(&m.key, key))
            .and_then(|m| self.text.get(m.value.clone()))
    }

    /// The key of the member at `index` (empty past the last one).
    fn key_at(&self, index: usize) -> &str {
        self.members.get(index).map_or("", |member| &member.key)
    }

    /// `indices` of members sorted by key, members of one key in the order given.
    fn sort_by_key(&self, indices: &mut [usize]) {
        // Stable: copies of a key keep their order.
        indices.sort_by(|&a, &b| compare_keys(self.key_at(a), self.key_at(b)));
    }

    /// The keys whose last member (the one JSON parsers keep) has a value `matches` holds
    /// for; found with one sort of the members, however many there are.
    pub fn keys_whose_value(&self, matches: impl Fn(&[u8]) -> bool) -> KeySet<'_> {
        let mut indices: Vec<usize> = (0..self.members.len()).collect();
        self.sort_by_key(&mut indices);
        let mut sorted = Vec::new();
        let mut rest = indices.iter().peekable();
        while let Some(&index) = rest.next() {
            let key = self.key_at(index);
            // The last of its key: the next one, if any, has another.
            let last = rest
                .peek()
                .is_none_or(|&&next| !same_key(self.key_at(next), key));
            let value = self
                .members
                .get(index)
                .and_then(|member| self.text.get(member.value.clone()));
            if last && value.is_some_and(&matches) {
                sorted.push(key);
            }
        }
        KeySet { sorted }
    }

    /// Whether the last member named `key` is there with a value other than `null`: what a
    /// pydantic model reads as set.
    pub fn is_set(&self, key: &str) -> bool {
        self.last_value(key).is_some_and(|value| value != b"null")
    }

    /// Whether the last member named `key` reads as true the way a pydantic model reads a
    /// bool in its default (lax) mode: `true`, a number equal to 1 (`1`, `1.0`, `1e0`), or a
    /// string, escapes decoded, such as "true", "yes", "on", "1" in any case.
    pub fn is_true(&self, key: &str) -> bool {
        let Some(value) = self.last_value(key) else {
            return false;
        };
        match value.first() {
            Some(b't') => value == b"true",
            Some(b'"') => serde_json::from_slice::<String>(value).is_ok_and(|text| {
                const TRUE: [&str; 6] = ["true", "1", "yes", "on", "t", "y"];
                let text = text.trim();
                TRUE.iter().any(|word| text.eq_ignore_ascii_case(word))
            }),
            Some(b'-' | b'0'..=b'9') => number(value).is_some_and(|number| number == 1.0),
            _ => false,
        }
    }

    /// Byte offset of the opening brace.
    pub fn open_brace(&self) -> usize {
        self.open_brace
    }

    /// Byte offset of the closing brace, where appended members go.
    pub fn close_brace(&self) -> usize {
        self.close_brace
    }

    /// Plans the document with each member edited as `edit` says and `append`ed members
    /// added before the closing brace. Whitespace and separators of kept members stay as
    /// they were. A key that `edit` changes (replaces, removes or fills with the slot) ends
    /// up with at most one member: earlier duplicates are removed and the last one is
    /// edited, the one JSON parsers keep. So no client can multiply what an edit adds.
    pub fn splice(
        &self,
        mut edit: impl FnMut(&str) -> Edit,
        append: &[(&'static str, Edit)],
    ) -> Splice {
        // Only the members `edit` changes are noted, in document order: a document of many
        // kept members costs nothing per member here.
        let mut edits: Vec<(usize, Edit)> = self
            .members
            .iter()
            .enumerate()
            .filter_map(|(index, member)| match edit(&member.key) {
                Edit::Keep => None,
                changed => Some((index, changed)),
            })
            .collect();
        // An edited member is superseded by a later edited one of the same key: sorted by
        // key (copies in order), each edited member but the last of its key. A sort, so
        // that many edited keys cost `n log n` comparisons, not `n * n`.
        let mut edited: Vec<usize> = edits.iter().map(|&(index, _)| index).collect();
        self.sort_by_key(&mut edited);
        for pair in edited.windows(2) {
            if let [earlier, later] = *pair {
                if same_key(self.key_at(earlier), self.key_at(later)) {
                    if let Ok(at) = edits.binary_search_by_key(&earlier, |&(index, _)| index) {
                        if let Some((_, superseded)) = edits.get_mut(at) {
                            *superseded = Edit::Remove;
                        }
                    }
                }
            }
        }
        drop(edited);

        // Grown as pieces come: kept members next to each other make one piece, so most
        // documents need a few, however many members they have.
        let mut splice = Splice::default();
        let after_open = self.open_brace + 1;
        splice.original(0..after_open);
        let mut cursor = after_open;
        let mut emitted_any = false;
        let mut edits = edits.iter().peekable();
        for (index, member) in self.members.iter().enumerate() {
            let edit = edits
                .next_if(|&&(edited, _)| edited == index)
                .map_or(Edit::Keep, |&(_, edit)| edit);
            if let Edit::Remove = edit {
                cursor = member.value.end;
                continue;
            }
            let mut lead = cursor..member.value.start;
            if !emitted_any && cursor != after_open {
                // Members before this one were removed: its leading comma has nothing
                // to separate any more.
                if let Some(comma) = span(self.text, lead.clone())
                    .iter()
                    .position(|&b| b == b',')
                {
                    lead.start += comma + 1;
                }
            }
            splice.original(lead);
            match edit {
                Edit::Replace(bytes) => splice.literal(bytes),
                Edit::Slot => splice.pieces.push(Piece::Slot),
                Edit::Value(index) => splice.pieces.push(Piece::Value(index)),
                Edit::Keep | Edit::Remove => splice.original(member.value.clone()),
            }
            cursor = member.value.end;
            emitted_any = true;
        }

        splice.original(cursor..self.close_brace);
        for (key, value) in append {
            let value = match value {
                Edit::Replace(bytes) => Piece::Literal(bytes),
                Edit::Slot => Piece::Slot,
                Edit::Value(index) => Piece::Value(*index),
                Edit::Keep | Edit::Remove => continue,
            };
            if emitted_any {
                splice.literal(b",");
            }
            splice.literal(b"\"");
            splice.literal(key.as_bytes());
            splice.literal(b"\":");
            splice.pieces.push(value);
            emitted_any = true;
        }
        splice.original(self.close_brace..self.text.len());
        // Planned for every member, kept for as long as a prefill call runs: only the pieces
        // it has, not room for two per member (several times the body for many small ones).
        splice.pieces.shrink_to_fit();
        splice
    }
}

impl<'a> JsonObject<'a> {
    /// [`JsonObject::splice`] with one key edited and every other member kept.
    pub fn splice_member(&self, key: &str, edit: Edit) -> Splice {
        // The usual case, one such member given a new value: its value's bytes replaced,
        // without the general plan's bookkeeping of removals and repeats.
        let mut named = self
            .members
            .iter()
            .filter(|member| same_key(&member.key, key));
        if let (Some(member), None, Edit::Replace(_) | Edit::Slot) =
            (named.next(), named.next(), edit)
        {
            let mut splice = Splice::default();
            splice.original(0..member.value.start);
            match edit {
                Edit::Replace(bytes) => splice.literal(bytes),
                _ => splice.pieces.push(Piece::Slot),
            }
            splice.original(member.value.end..self.text.len());
            return splice;
        }
        self.splice(
            |member| {
                if member == key {
                    edit
                } else {
                    Edit::Keep
                }
            },
            &[],
        )
    }
}

/// What to do with a member when splicing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    Keep,
    Replace(&'static [u8]),
    /// Replace with the value given when the splice is written.
    Slot,
    /// Replace with the value at this index of those given to [`Splice::write_values`].
    Value(usize),
    Remove,
}

/// A planned rewrite of a document: which of its bytes to keep, in which order, with which
/// literals and where the one runtime value goes. Its length is known before it is written.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Splice {
    pieces: Vec<Piece>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Original(Range<usize>),
    Literal(&'static [u8]),
    Slot,
    Value(usize),
}

impl Splice {
    fn original(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        if let Some(Piece::Original(last)) = self.pieces.last_mut() {
            if last.end == range.start {
                last.end = range.end;
                return;
            }
        }
        self.pieces.push(Piece::Original(range));
    }

    fn literal(&mut self, bytes: &'static [u8]) {
        self.pieces.push(Piece::Literal(bytes));
    }

    /// The length of the written document with `slot_len` bytes in the slot.
    pub fn len(&self, slot_len: usize) -> usize {
        self.written_len(slot_len, &[])
    }

    fn written_len(&self, slot_len: usize, values: &[&[u8]]) -> usize {
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Original(range) => range.len(),
                Piece::Literal(bytes) => bytes.len(),
                Piece::Slot => slot_len,
                Piece::Value(index) => values.get(*index).map_or(0, |value| value.len()),
            })
            .sum()
    }

    /// The bytes the plan itself takes in memory, beyond its own few.
    pub fn heap_bytes(&self) -> usize {
        self.pieces
            .capacity()
            .saturating_mul(std::mem::size_of::<Piece>())
    }

    /// Whether the document keeps the slot somewhere.
    pub fn has_slot(&self) -> bool {
        self.pieces.contains(&Piece::Slot)
    }

    /// Writes the document from `text`, the one the splice was planned on.
    pub fn write(&self, text: &[u8], slot: &[u8]) -> Vec<u8> {
        self.write_with(text, slot, &[])
    }

    /// Writes the document from `text`, each [`Edit::Value`] given its value from `values`
    /// (none for an index past them).
    pub fn write_values(&self, text: &[u8], values: &[&[u8]]) -> Vec<u8> {
        self.write_with(text, b"", values)
    }

    fn write_with(&self, text: &[u8], slot: &[u8], values: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.written_len(slot.len(), values));
        for piece in &self.pieces {
            match piece {
                Piece::Original(range) => out.extend_from_slice(span(text, range.clone())),
                Piece::Literal(bytes) => out.extend_from_slice(bytes),
                Piece::Slot => out.extend_from_slice(slot),
                Piece::Value(index) => {
                    out.extend_from_slice(values.get(*index).copied().unwrap_or_default())
                }
            }
        }
        out
    }
}

/// The elements of a JSON array, each as the slice of `array` it is written in; `None` when
/// `array` is not one.
pub fn array_elements(array: &[u8]) -> Option<Vec<&[u8]>> {
    let ranges = array_element_ranges(array)?;
    Some(ranges.into_iter().map(|range| span(array, range)).collect())
}

/// Where each element of a JSON array lies in `array`; `None` when `array` is not one valid
/// JSON array (surrounding whitespace allowed).
pub fn array_element_ranges(array: &[u8]) -> Option<Vec<Range<usize>>> {
    let mut elements = Vec::new();
    each_array_element_range(array, |range| elements.push(range))?;
    Some(elements)
}

/// Calls `each` with each element of a JSON array, as the slice of `array` it is written in,
/// and gives their number; `None` when `array` is not one valid JSON array (surrounding
/// whitespace allowed), after `each` saw the elements before the fault. No list of the
/// elements is made.
pub fn for_each_array_element(array: &[u8], mut each: impl FnMut(&[u8])) -> Option<usize> {
    let mut count = 0usize;
    each_array_element_range(array, |range| {
        count += 1;
        each(span(array, range));
    })?;
    Some(count)
}

/// Calls `each` with where each element of a JSON array lies in `array`; `None` when `array`
/// is not one valid JSON array (surrounding whitespace allowed).
fn each_array_element_range(array: &[u8], mut each: impl FnMut(Range<usize>)) -> Option<()> {
    let mut scanner = Scanner {
        bytes: array,
        pos: 0,
        longest_integer: 0,
        deepest: 0,
    };
    scanner
        .container(b'[', "expected a JSON array", |scanner| {
            scanner.skip_whitespace();
            let start = scanner.pos;
            scanner.value()?;
            each(start..scanner.pos);
            Ok(())
        })
        .ok()?;
    scanner.at_end().then_some(())
}

/// A JSON number (from a validated document) as Python's `json` reads it, to the nearest
/// double as its `float()` rounds: `NaN`, `Infinity` and `-Infinity` too, and a number too
/// large for a double is infinite. `None` for any other value. (serde_json without its
/// `float_roundtrip` feature, as this crate builds it for wasm, can land a double off: it read
/// `1.00000000000000011`, which Python reads as 1.0, as 1.0000000000000002.)
pub fn number(value: &[u8]) -> Option<f64> {
    match value.first() {
        Some(b'-' | b'0'..=b'9' | b'N' | b'I') => std::str::from_utf8(value).ok()?.parse().ok(),
        _ => None,
    }
}

/// What [`find_top_level_member`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberSearch {
    /// Where the value of the last member with that key lies (the one JSON parsers keep).
    Found(Range<usize>),
    /// The object has no member with that key.
    Absent,
    /// The quick look cannot tell: a top-level key after the member holds escapes (it could
    /// spell the key), the member's value is empty, or the text is not shaped as one object.
    /// [`JsonObject::parse`] can.
    Unsure,
}

/// Where the value of the last top-level member named `key` lies, found without validating
/// the document: read backwards from its end, following strings and nesting alone, and only
/// as far as that member. For documents from a trusted writer (decode's answers, which vLLM
/// serializes, usage near their end), whose cost then does not grow with the text before the
/// member. On a valid object it agrees with [`JsonObject::last_value`] whenever it is not
/// [`MemberSearch::Unsure`].
pub fn find_top_level_member(text: &[u8], key: &str) -> MemberSearch {
    let Some(close) = text.iter().rposition(|byte| !byte.is_ascii_whitespace()) else {
        return MemberSearch::Unsure;
    };
    if text.get(close) != Some(&b'}') {
        return MemberSearch::Unsure;
    }
    let mut pos = close;
    let mut depth = 1usize;
    // The separator after the member being read (its `,`, or the closing brace), and its `:`
    // once passed: the next string then is the member's key.
    let mut separator = close;
    let mut colon = None;
    while pos > 0 {
        pos -= 1;
        match text.get(pos) {
            Some(b'"') => {
                let Some(open) = string_start(text, pos) else {
                    return MemberSearch::Unsure;
                };
                if let (1, Some(colon)) = (depth, colon) {
                    let raw = text.get(open + 1..pos).unwrap_or_default();
                    if raw.contains(&b'\\') {
                        return MemberSearch::Unsure;
                    }
                    if raw == key.as_bytes() {
                        let start = skip_whitespace(text, colon + 1);
                        let value = start..value_end(text, start, separator);
                        if value.is_empty() {
                            return MemberSearch::Unsure;
                        }
                        return MemberSearch::Found(value);
                    }
                }
                pos = open;
            }
            Some(b':') if depth == 1 => colon = Some(pos),
            Some(b',') if depth == 1 => {
                separator = pos;
                colon = None;
            }
            Some(b'}' | b']') => depth += 1,
            Some(byte @ (b'{' | b'[')) => {
                depth -= 1;
                if depth == 0 {
                    let opens = *byte == b'{' && skip_whitespace(text, 0) == pos;
                    return if opens {
                        MemberSearch::Absent
                    } else {
                        MemberSearch::Unsure
                    };
                }
            }
            _ => {}
        }
    }
    MemberSearch::Unsure
}

/// Where a value that starts at `start` ends, given the separator that follows it: before
/// the whitespace between the two.
fn value_end(text: &[u8], start: usize, separator: usize) -> usize {
    let value = text.get(start..separator).unwrap_or_default();
    start + value.trim_ascii_end().len()
}

/// The opening quote of the string whose closing quote is at `close`: the first `"` before
/// it that no escape takes (one after an odd run of backslashes is escaped).
fn string_start(text: &[u8], close: usize) -> Option<usize> {
    let mut end = close;
    loop {
        let quote = text.get(..end)?.iter().rposition(|&byte| byte == b'"')?;
        let before = text.get(..quote).unwrap_or_default();
        let backslashes = before
            .iter()
            .rev()
            .take_while(|&&byte| byte == b'\\')
            .count();
        if backslashes % 2 == 0 {
            return Some(quote);
        }
        end = quote;
    }
}

fn skip_whitespace(text: &[u8], from: usize) -> usize {
    let rest = text.get(from..).unwrap_or_default();
    from + rest
        .iter()
        .position(|byte| !matches!(byte, b' ' | b'\t' | b'\n' | b'\r'))
        .unwrap_or(rest.len())
}

/// The bytes of a range the parser produced (always in bounds).
fn span(bytes: &[u8], range: Range<usize>) -> &[u8] {
    bytes.get(range).unwrap_or_default()
}

struct Scanner<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The digits of the longest integer literal taken so far.
    longest_integer: usize,
    /// The most containers open inside one value so far, an empty one counted.
    deepest: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

/// The containers a value has open, innermost last: a bit per level (set for an object) in
/// one word, so that the usual few levels cost no allocation; deeper levels on the heap.
#[derive(Default)]
struct OpenContainers {
    depth: usize,
    first_levels: u64,
    deeper: Vec<Container>,
}

impl OpenContainers {
    fn push(&mut self, container: Container) {
        if self.depth < 64 {
            let bit = 1u64 << self.depth;
            if container == Container::Object {
                self.first_levels |= bit;
            } else {
                self.first_levels &= !bit;
            }
        } else {
            self.deeper.push(container);
        }
        self.depth += 1;
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth = self.depth.saturating_sub(1);
    }

    fn innermost(&self) -> Option<Container> {
        match self.depth {
            0 => None,
            1..=64 => Some(if self.first_levels >> (self.depth - 1) & 1 == 1 {
                Container::Object
            } else {
                Container::Array
            }),
            _ => self.deeper.last().copied(),
        }
    }
}

/// Whether a byte inside a string needs a look: `"`, `\\`, a control byte (which JSON forbids
/// there) or a non-ASCII byte (whose UTF-8 is checked).
fn is_special(byte: u8) -> bool {
    byte == b'"' || byte == b'\\' || !(0x20..0x80).contains(&byte)
}

/// One bit per byte of the 64 bytes from `at` (bit `i` for byte `at + i`), set where the byte
/// needs a look inside a string ([`is_special`]); bytes past the end count as plain. SIMD
/// where the target has it, [`special_mask_bytewise`] otherwise.
pub fn special_mask(bytes: &[u8], at: usize) -> u64 {
    match bytes.get(at..at + 64) {
        Some(block) => special_mask_64(block),
        None => {
            // The end of the document: pad with plain bytes.
            let mut block = [b'a'; 64];
            let rest = bytes.get(at..).unwrap_or_default();
            if let Some(head) = block.get_mut(..rest.len()) {
                head.copy_from_slice(rest);
            }
            special_mask_64(&block)
        }
    }
}

/// The mask of a block of 64 bytes, sixteen at a time.
fn special_mask_64(block: &[u8]) -> u64 {
    block
        .chunks_exact(16)
        .take(4)
        .enumerate()
        .fold(0, |mask, (i, chunk)| {
            mask | u64::from(simd::special_mask_16(chunk)) << (16 * i)
        })
}

/// [`special_mask`] a byte at a time: the portable path, and the reference the SIMD paths are
/// checked against.
pub fn special_mask_bytewise(bytes: &[u8], at: usize) -> u64 {
    let block = bytes.get(at..).unwrap_or_default();
    block
        .iter()
        .take(64)
        .enumerate()
        .filter(|(_, &byte)| is_special(byte))
        .fold(0, |mask, (i, _)| mask | 1 << i)
}

/// [`special_mask`] of 16 bytes: compare with `"` and `\\`, and a
/// signed compare below 0x20, which catches the control bytes (0x00 to 0x1f) and the
/// non-ASCII ones (0x80 to 0xff, negative as signed bytes) at once.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd {
    use core::arch::wasm32::{
        i8x16_bitmask, i8x16_eq, i8x16_lt, i8x16_splat, v128, v128_load, v128_or,
    };

    /// The mask of the first 16 bytes of `chunk`, which has at least 16.
    pub fn special_mask_16(chunk: &[u8]) -> u16 {
        let Some(chunk) = chunk.get(..16) else {
            return 0;
        };
        // SAFETY: `chunk` is 16 readable bytes; v128_load has no alignment requirement.
        let v = unsafe { v128_load(chunk.as_ptr().cast::<v128>()) };
        let special = v128_or(
            v128_or(
                i8x16_eq(v, i8x16_splat(b'"' as i8)),
                i8x16_eq(v, i8x16_splat(b'\\' as i8)),
            ),
            i8x16_lt(v, i8x16_splat(0x20)),
        );
        i8x16_bitmask(special)
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use core::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };

    /// The mask of the first 16 bytes of `chunk`, which has at least 16.
    pub fn special_mask_16(chunk: &[u8]) -> u16 {
        let Some(chunk) = chunk.get(..16) else {
            return 0;
        };
        // SAFETY: SSE2 is part of x86-64; `chunk` is 16 readable bytes and the load is
        // unaligned.
        let bits = unsafe {
            let v = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
            let special = _mm_or_si128(
                _mm_or_si128(
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8)),
                    _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8)),
                ),
                _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)),
            );
            _mm_movemask_epi8(special)
        };
        bits as u16
    }
}

#[cfg(not(any(
    all(target_arch = "wasm32", target_feature = "simd128"),
    target_arch = "x86_64"
)))]
mod simd {
    pub fn special_mask_16(chunk: &[u8]) -> u16 {
        super::special_mask_bytewise(chunk.get(..16).unwrap_or_default(), 0) as u16
    }
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    /// The object or array (`open`: `{` or `[`) that starts after any whitespace, each of
    /// its items read by `item`; where it opens. The position is left past its close.
    fn container(
        &mut self,
        open: u8,
        not_it: &'static str,
        mut item: impl FnMut(&mut Self) -> Result<(), JsonError>,
    ) -> Result<usize, JsonError> {
        let (close, separator) = if open == b'{' {
            (b'}', "expected ',' or '}'")
        } else {
            (b']', "expected ',' or ']'")
        };
        self.skip_whitespace();
        let opened = self.pos;
        if self.peek() != Some(open) {
            return Err(self.error(not_it));
        }
        self.pos += 1;
        self.skip_whitespace();
        if self.peek() == Some(close) {
            self.pos += 1;
            return Ok(opened);
        }
        loop {
            item(self)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(byte) if byte == close => {
                    self.pos += 1;
                    return Ok(opened);
                }
                _ => return Err(self.error(separator)),
            }
        }
    }

    /// Whether only whitespace is left.
    fn at_end(&mut self) -> bool {
        self.skip_whitespace();
        self.pos == self.bytes.len()
    }

    fn error(&self, what: &'static str) -> JsonError {
        let kind = if self.pos >= self.bytes.len() {
            JsonErrorKind::Syntax("unexpected end of input")
        } else {
            JsonErrorKind::Syntax(what)
        };
        JsonError {
            kind,
            offset: self.pos,
        }
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.pos += 1;
        }
    }

    /// `"key" :` with the position left at the value.
    fn key(&mut self) -> Result<Cow<'a, str>, JsonError> {
        self.skip_whitespace();
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string key"));
        }
        let start = self.pos;
        let escaped = self.string()?;
        let raw = self.bytes.get(start..self.pos).unwrap_or_default();
        let key = if escaped {
            Cow::Owned(
                serde_json::from_slice::<String>(raw).map_err(|_| JsonError {
                    kind: JsonErrorKind::Syntax("invalid escape in a key"),
                    offset: start,
                })?,
            )
        } else {
            let inner = raw.get(1..raw.len().saturating_sub(1)).unwrap_or_default();
            // SAFETY: `Scanner::string` took these bytes without escapes only if each is
            // ASCII or part of a run of non-ASCII bytes it checked as UTF-8 (`non_ascii`),
            // and such runs end at ASCII bytes: the whole is UTF-8.
            Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(inner) })
        };
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return Err(self.error("expected ':'"));
        }
        self.pos += 1;
        Ok(key)
    }

    /// `"key" :` inside a value, checked as [`Scanner::key`] checks it, with the position
    /// left at the value; the key itself is not needed.
    fn nested_key(&mut self) -> Result<(), JsonError> {
        self.skip_whitespace();
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string key"));
        }
        let start = self.pos;
        if self.string()? {
            // Escapes are checked as a key's: the rare case, left to the full check.
            let raw = self.bytes.get(start..self.pos).unwrap_or_default();
            if serde_json::from_slice::<String>(raw).is_err() {
                return Err(JsonError {
                    kind: JsonErrorKind::Syntax("invalid escape in a key"),
                    offset: start,
                });
            }
        }
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return Err(self.error("expected ':'"));
        }
        self.pos += 1;
        Ok(())
    }

    /// One complete value of any depth.
    fn value(&mut self) -> Result<(), JsonError> {
        let mut open = OpenContainers::default();
        loop {
            self.skip_whitespace();
            match self.peek() {
                Some(b'{') => {
                    self.pos += 1;
                    self.deepest = self.deepest.max(open.depth + 1);
                    self.skip_whitespace();
                    if self.peek() == Some(b'}') {
                        self.pos += 1;
                    } else {
                        open.push(Container::Object);
                        self.nested_key()?;
                        continue;
                    }
                }
                Some(b'[') => {
                    self.pos += 1;
                    self.deepest = self.deepest.max(open.depth + 1);
                    self.skip_whitespace();
                    if self.peek() == Some(b']') {
                        self.pos += 1;
                    } else {
                        open.push(Container::Array);
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b'-' | b'0'..=b'9') => self.number()?,
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                // Python's json module (so vLLM) reads and Python clients write them.
                Some(b'N') => self.literal(b"NaN")?,
                Some(b'I') => self.literal(b"Infinity")?,
                _ => return Err(self.error("expected a value")),
            }
            // A value is complete: close what it completes, stop at the next separator.
            loop {
                let Some(container) = open.innermost() else {
                    return Ok(());
                };
                self.skip_whitespace();
                match (container, self.peek()) {
                    (Container::Object, Some(b',')) => {
                        self.pos += 1;
                        self.nested_key()?;
                        break;
                    }
                    (Container::Array, Some(b',')) => {
                        self.pos += 1;
                        break;
                    }
                    (Container::Object, Some(b'}')) | (Container::Array, Some(b']')) => {
                        self.pos += 1;
                        open.pop();
                    }
                    (Container::Object, _) => return Err(self.error("expected ',' or '}'")),
                    (Container::Array, _) => return Err(self.error("expected ',' or ']'")),
                }
            }
        }
    }

    /// A string starting at its opening quote; returns whether it holds escapes. The string
    /// is taken 64 bytes at a time: one mask of the bytes that need a look, then only those
    /// are looked at.
    fn string(&mut self) -> Result<bool, JsonError> {
        self.pos += 1;
        // Most strings (keys, short values) end within 32 bytes: when the first byte that
        // needs a look there is the closing quote, a compare or two have read the whole
        // string.
        for _ in 0..2 {
            let Some(chunk) = self.bytes.get(self.pos..self.pos + 16) else {
                break;
            };
            let mask = simd::special_mask_16(chunk);
            if mask == 0 {
                self.pos += 16;
                continue;
            }
            let first = self.pos + mask.trailing_zeros() as usize;
            if self.bytes.get(first) == Some(&b'"') {
                self.pos = first + 1;
                return Ok(false);
            }
            break;
        }
        let mut escaped = false;
        loop {
            let block = self.pos;
            if block >= self.bytes.len() {
                self.pos = self.bytes.len();
                return Err(self.error("unterminated string"));
            }
            let mut mask = special_mask(self.bytes, block);
            loop {
                if mask == 0 {
                    self.pos = block + 64;
                    break;
                }
                self.pos = block + mask.trailing_zeros() as usize;
                match self.peek() {
                    Some(b'"') => {
                        self.pos += 1;
                        return Ok(escaped);
                    }
                    Some(b'\\') => {
                        escaped = true;
                        self.escape()?;
                    }
                    Some(0x80..=0xff) => self.non_ascii()?,
                    _ => return Err(self.error("control character in a string")),
                }
                // Past what was just taken (an escape may hide a `"` or `\\` in the mask).
                let taken = self.pos - block;
                if taken >= 64 {
                    break;
                }
                mask &= u64::MAX << taken;
            }
        }
    }

    fn escape(&mut self) -> Result<(), JsonError> {
        match self.bytes.get(self.pos + 1) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                self.pos += 2;
                Ok(())
            }
            Some(b'u') => {
                let digits = self.bytes.get(self.pos + 2..self.pos + 6);
                if digits.is_some_and(|d| d.iter().all(u8::is_ascii_hexdigit)) {
                    self.pos += 6;
                    Ok(())
                } else {
                    Err(self.error("invalid \\u escape"))
                }
            }
            _ => Err(self.error("invalid escape")),
        }
    }

    /// A run of non-ASCII bytes inside a string: it must be whole UTF-8 characters.
    fn non_ascii(&mut self) -> Result<(), JsonError> {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        let run = rest.iter().position(u8::is_ascii).unwrap_or(rest.len());
        let chars = rest.get(..run).unwrap_or_default();
        if std::str::from_utf8(chars).is_err() {
            return Err(JsonError {
                kind: JsonErrorKind::InvalidUtf8,
                offset: self.pos,
            });
        }
        self.pos += run;
        Ok(())
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, or `-Infinity`.
    fn number(&mut self) -> Result<(), JsonError> {
        if self.peek() == Some(b'-') {
            self.pos += 1;
            if self.peek() == Some(b'I') {
                return self.literal(b"Infinity");
            }
        }
        let integer_digits = match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                1
            }
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.error("invalid number")),
        };
        let mut integer = true;
        if self.peek() == Some(b'.') {
            integer = false;
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            integer = false;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("invalid number"));
            }
        }
        if integer {
            self.longest_integer = self.longest_integer.max(integer_digits);
        }
        Ok(())
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<(), JsonError> {
        if self.bytes.get(self.pos..self.pos + word.len()) == Some(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("invalid literal"))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn valid(text: &[u8]) -> bool {
        JsonObject::parse(text).is_ok()
    }

    #[test]
    fn the_quick_member_search_reads_only_the_top_level() {
        fn found(text: &[u8]) -> Result<&[u8], MemberSearch> {
            match find_top_level_member(text, "usage") {
                MemberSearch::Found(range) => Ok(&text[range]),
                other => Err(other),
            }
        }
        assert_eq!(
            found(br#"{"a":{"usage":1},"s":"\"usage\":2","usage" : {"x":[1,"}"]} ,"b":3}"#),
            Ok(&br#"{"x":[1,"}"]}"#[..])
        );
        assert_eq!(found(b" {\"usage\":null}\n"), Ok(&b"null"[..]));
        assert_eq!(found(br#"{"a":"\\","usage":7}"#), Ok(&b"7"[..]));
        assert_eq!(found(br#"{"a":{"usage":1}}"#), Err(MemberSearch::Absent));
        assert_eq!(found(b"{}"), Err(MemberSearch::Absent));
        // What it cannot tell is left to the validating scanner.
        for text in [
            &br#"{"us\u0061ge":1}"#[..],
            br#"{"usage":1}x"#,
            br#"["usage"]"#,
            br#"{"usage":}"#,
            br#"{"usage":1"#,
            b"",
        ] {
            assert_eq!(
                found(text),
                Err(MemberSearch::Unsure),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }

    #[test]
    fn one_members_new_value_is_spliced_as_the_general_plan_splices_it() {
        for text in [
            &br#"{"usage":{"a":1}}"#[..],
            br#" { "id" : "x" , "usage" : null , "z" : [1] } "#,
            br#"{"a":{"usage":2},"usage":3}"#,
        ] {
            let object = JsonObject::parse(text).unwrap();
            let general = object.splice(
                |key| match key {
                    "usage" => Edit::Slot,
                    _ => Edit::Keep,
                },
                &[],
            );
            assert_eq!(
                object.splice_member("usage", Edit::Slot).write(text, b"{}"),
                general.write(text, b"{}"),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
    }

    #[test]
    fn accepts_objects_of_every_value_kind() {
        let text = br#" {"a":1,"b":-0.5e+10,"c":"x\"y\u00e9\n","d":[true,false,null,[],{}],"e":{"f":{"g":[1,[2,[3]]]}},"\u0041":0,"h":[NaN,Infinity,-Infinity]} "#;
        let object = JsonObject::parse(text).unwrap();
        let keys: Vec<&str> = object.members.iter().map(|m| m.key.as_ref()).collect();
        assert_eq!(keys, ["a", "b", "c", "d", "e", "A", "h"]);
        let value = &object.members[3].value;
        assert_eq!(&text[value.clone()], b"[true,false,null,[],{}]");
        assert_eq!(text[object.open_brace], b'{');
        assert_eq!(text[object.close_brace], b'}');
    }

    #[test]
    fn rejects_what_json_rejects() {
        for text in [
            &b""[..],
            b"[]",
            b"1",
            b"{",
            b"{}x",
            b"{\"a\":}",
            b"{\"a\" 1}",
            b"{\"a\":1,}",
            b"{\"a\":01}",
            b"{\"a\":1.}",
            b"{\"a\":.5}",
            b"{\"a\":1e}",
            b"{\"a\":-}",
            b"{\"a\":tru}",
            b"{\"a\":[1,]}",
            b"{\"a\":[1 2]}",
            b"{\"a\":{\"b\"}}",
            b"{\"a\":\"\x01\"}",
            b"{\"a\":\"\\x\"}",
            b"{\"a\":\"\\u12\"}",
            b"{a:1}",
            b"{\"a\":\"unterminated}",
            b"{\"a\":[}",
            b"{\"a\":{]}",
            b"{'a':1}",
            // Python's json reads these three spellings only, and never as keys.
            b"{\"a\":nan}",
            b"{\"a\":-NaN}",
            b"{\"a\":Inf}",
            b"{\"a\":+Infinity}",
            b"{\"a\":infinity}",
            b"{NaN:1}",
        ] {
            assert!(!valid(text), "{}", String::from_utf8_lossy(text));
        }
    }

    #[test]
    fn checks_utf8_inside_strings() {
        assert!(valid("{\"é\":\"日本語 😀\"}".as_bytes()));
        let err = scan_object(b"{\"a\":\"\xff\"}").unwrap_err();
        assert_eq!(err.kind, JsonErrorKind::InvalidUtf8);
        assert_eq!(err.offset, 6);
        assert_eq!(
            scan_object(b"{\"\xc3\":1}").unwrap_err().kind,
            JsonErrorKind::InvalidUtf8
        );
        // Truncated and overlong sequences.
        assert!(!valid(b"{\"a\":\"\xe6\x97\"}"));
        assert!(!valid(b"{\"a\":\"\xc0\xaf\"}"));
    }

    #[test]
    fn the_fast_path_stops_at_every_special_byte() {
        for special in [b'"', b'\\', 0x1f, 0x80] {
            for position in 0..17 {
                let mut inner = vec![b'a'; 16];
                inner[position % 16] = special;
                let mut text = b"{\"k\":\"".to_vec();
                text.extend_from_slice(&inner);
                text.extend_from_slice(b"\"}");
                let ours = valid(&text);
                let serde = serde_json::from_slice::<serde_json::Value>(&text).is_ok();
                assert_eq!(ours, serde, "{special:#x} at {position}");
            }
        }
    }

    #[test]
    fn the_simd_mask_marks_the_bytes_the_bytewise_one_does() {
        // Every length up to 140, every start, each kind of byte that needs a look at every
        // position, and random bytes: the SIMD path of this target (wasm simd128 under
        // `make test-wasm`, SSE2 natively) against the bytewise reference.
        let mut state: u32 = 0x2545_f491;
        let mut random = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        for len in 0..140 {
            let mut cases: Vec<Vec<u8>> = vec![vec![b'a'; len]];
            for special in [b'"', b'\\', 0x00, 0x1f, 0x80, 0xc3, 0xff] {
                for position in (0..len).step_by(3) {
                    let mut bytes = vec![b'x'; len];
                    bytes[position] = special;
                    cases.push(bytes);
                }
            }
            for _ in 0..8 {
                cases.push(
                    (0..len)
                        .map(|_| {
                            let r = random();
                            if r % 7 == 0 {
                                (r >> 8) as u8
                            } else {
                                b' ' + (r >> 8) as u8 % 95
                            }
                        })
                        .collect(),
                );
            }
            for bytes in &cases {
                for at in 0..=len {
                    assert_eq!(
                        special_mask(bytes, at),
                        special_mask_bytewise(bytes, at),
                        "{bytes:?} {at}"
                    );
                }
            }
        }
        // Plain ASCII, including 0x7f (DEL, which JSON allows in strings), needs no look.
        let plain: Vec<u8> = (0x20..0x80).filter(|b| *b != b'"' && *b != b'\\').collect();
        assert_eq!(special_mask(&plain, 0), 0);
    }

    #[test]
    fn deep_nesting_uses_no_call_stack() {
        let depth = 200_000;
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
        assert!(valid(deep.as_bytes()));
        let unbalanced = format!("{{\"a\":{}}}", "[".repeat(depth));
        assert!(!valid(unbalanced.as_bytes()));
    }

    #[test]
    fn errors_say_where() {
        let err = scan_object(b"{\"a\":1,}").unwrap_err();
        assert_eq!(err.to_string(), "expected a string key at byte 7");
        let err = scan_object(b"{\"a\":").unwrap_err();
        assert_eq!(err.to_string(), "unexpected end of input at byte 5");
    }

    // Splicing.

    fn splice_str(
        text: &str,
        edit: impl FnMut(&str) -> Edit,
        append: &[(&'static str, Edit)],
    ) -> String {
        let object = JsonObject::parse(text.as_bytes()).unwrap();
        let splice = object.splice(edit, append);
        let written = splice.write(text.as_bytes(), b"SLOT");
        assert_eq!(written.len(), splice.len(4));
        String::from_utf8(written).unwrap()
    }

    #[test]
    fn indexes_members_with_exact_value_text() {
        let text = r#" { "a" : 1.50 , "b\u0022": {"x": [1,2]}, "c":"\u00e9" } "#;
        let object = JsonObject::parse(text.as_bytes()).unwrap();
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
    fn finds_where_each_array_element_is_written() {
        let text = r#" [ 1 , {"a": [2, "]"]} ,"x",[] , null ] "#;
        let found: Vec<&str> = array_element_ranges(text.as_bytes())
            .unwrap()
            .into_iter()
            .map(|range| &text[range])
            .collect();
        assert_eq!(found, ["1", r#"{"a": [2, "]"]}"#, r#""x""#, "[]", "null"]);
        assert_eq!(array_element_ranges(b" [ ] "), Some(vec![]));
        let not_arrays: [&[u8]; 8] = [
            b"",
            b"{}",
            b"[1,]",
            b"[,1]",
            b"[1 2]",
            b"[1]x",
            b"[1",
            b"[\"\xff\"]",
        ];
        for text in not_arrays {
            assert_eq!(array_element_ranges(text), None, "{text:?}");
        }
    }

    #[test]
    fn rejects_what_is_not_an_object() {
        for text in ["", "[]", "1", "\"s\"", "{", "{}x", "{\"a\":}", "null"] {
            assert!(JsonObject::parse(text.as_bytes()).is_err(), "{text:?}");
        }
    }

    #[test]
    fn deep_nesting_inside_a_value_does_not_overflow_the_stack() {
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(50_000), "]".repeat(50_000));
        let object = JsonObject::parse(deep.as_bytes()).unwrap();
        assert_eq!(object.members()[0].value.len(), 100_000);
        let unbalanced = format!("{{\"a\":{}}}", "[".repeat(50_000));
        assert!(JsonObject::parse(unbalanced.as_bytes()).is_err());
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
            &[("c", Edit::Replace(b"1")), ("d", Edit::Replace(b"{}"))],
        );
        assert_eq!(out, r#"{"a":1,"b":false,"c":1,"d":{}}"#);
    }

    #[test]
    fn appends_into_empty_and_emptied_objects() {
        assert_eq!(
            splice_str(" {} ", |_| Edit::Keep, &[("k", Edit::Slot)]),
            r#" {"k":SLOT} "#
        );
        assert_eq!(
            splice_str(
                r#"{"x":0}"#,
                |_| Edit::Remove,
                &[("k", Edit::Replace(b"1")), ("j", Edit::Replace(b"2"))]
            ),
            r#"{"k":1,"j":2}"#
        );
    }

    #[test]
    fn an_edited_key_keeps_only_its_last_member() {
        let edit = |k: &str| match k {
            "a" => Edit::Slot,
            "b" => Edit::Replace(b"0"),
            _ => Edit::Keep,
        };
        assert_eq!(
            splice_str(r#"{"a":1,"b":5,"a":2,"c":[],"b":6,"c":7}"#, edit, &[]),
            r#"{"a":SLOT,"c":[],"b":0,"c":7}"#
        );
        let many = format!("{{{}\"p\":1}}", "\"a\":0,".repeat(10_000));
        assert_eq!(splice_str(&many, edit, &[]), r#"{"a":SLOT,"p":1}"#);
    }

    /// An object of `n` distinct keys, each `null`: `{"k0":null,"k1":null,…}`.
    pub(crate) fn null_members(n: usize) -> String {
        let members: Vec<String> = (0..n).map(|i| format!("\"k{i}\":null")).collect();
        format!("{{{}}}", members.join(","))
    }

    /// The most key comparisons sorting `n` keys, and a pass over them, may take: about
    /// `2 n log2 n`. Comparing each with each is `n * n / 2`.
    pub(crate) fn n_log_n_comparisons(n: usize) -> usize {
        2 * n * (usize::BITS - n.leading_zeros()) as usize + n
    }

    #[test]
    fn planning_a_splice_of_many_edited_keys_takes_about_n_log_n_comparisons() {
        // Every member edited, each key once (as usage's null details are removed): the
        // plan's look for a later copy of each key must not compare it with every other.
        let n = 10_000;
        let text = null_members(n);
        let object = JsonObject::parse(text.as_bytes()).unwrap();
        let before = key_comparisons();
        let splice = object.splice(|_| Edit::Remove, &[("z", Edit::Replace(b"1"))]);
        let compared = key_comparisons() - before;
        assert_eq!(splice.write(text.as_bytes(), b""), br#"{"z":1}"#);
        assert!(
            compared <= n_log_n_comparisons(n),
            "{compared} key comparisons for {n} members"
        );
        // Copies of one key, every one edited: one is kept, at no more cost.
        let text = format!("{{{}\"p\":1}}", "\"a\":0,".repeat(n));
        let object = JsonObject::parse(text.as_bytes()).unwrap();
        let before = key_comparisons();
        let splice = object.splice(|key| if key == "a" { Edit::Slot } else { Edit::Keep }, &[]);
        let compared = key_comparisons() - before;
        assert_eq!(splice.write(text.as_bytes(), b"2"), br#"{"a":2,"p":1}"#);
        assert!(compared <= n_log_n_comparisons(n), "{compared}");
    }

    #[test]
    fn a_splice_keeps_only_the_pieces_it_has() {
        // A plan outlives the parse (kept while a prefill call runs): a document of many
        // small members, few of them edited, must not leave it room for two per member.
        let n = 100_000;
        let text = format!(r#"{{"p":1{}}}"#, r#","":0"#.repeat(n));
        let object = JsonObject::parse(text.as_bytes()).unwrap();
        let splice = object.splice(|key| if key == "p" { Edit::Slot } else { Edit::Keep }, &[]);
        assert_eq!(splice.pieces.len(), 3, "before, the slot, after");
        assert_eq!(splice.heap_bytes(), 3 * std::mem::size_of::<Piece>());
        // Where many members are edited, the plan has as many pieces, and says so.
        let text = format!(r#"{{"p":1{}}}"#, r#","k":0,"":0"#.repeat(n));
        let object = JsonObject::parse(text.as_bytes()).unwrap();
        let splice = object.splice(
            |key| if key == "k" { Edit::Remove } else { Edit::Keep },
            &[],
        );
        assert!(splice.pieces.len() > n);
        assert_eq!(
            splice.heap_bytes(),
            splice.pieces.len() * std::mem::size_of::<Piece>()
        );
    }

    #[test]
    fn the_depth_counts_every_container_open_at_once() {
        let depth = |text: &[u8]| JsonObject::parse(text).unwrap().depth();
        assert_eq!(depth(b"{}"), 1);
        assert_eq!(depth(br#"{"a":1,"b":"[{"}"#), 1);
        assert_eq!(depth(br#"{"a":[]}"#), 2);
        assert_eq!(depth(br#"{"a":[{}],"b":{"c":[[1],[2,[3]]]}}"#), 5);
        let deep = format!(r#"{{"a":{}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert_eq!(depth(deep.as_bytes()), 201);
    }

    #[test]
    fn the_longest_integer_literal_is_counted_at_any_depth() {
        let text = br#"{"a":[12,-345,6.78901,1e99999,"123456"],"b":{"c":[[0]]}}"#;
        assert_eq!(JsonObject::parse(text).unwrap().longest_integer(), 3);
        assert_eq!(JsonObject::parse(b"{}").unwrap().longest_integer(), 0);
        assert_eq!(
            JsonObject::parse(br#"{"a":0}"#).unwrap().longest_integer(),
            1
        );
    }

    #[test]
    fn numbers_are_read_to_the_nearest_double_as_python_reads_them() {
        // Python's float() rounds a decimal to the nearest double: 1.00000000000000011 is
        // 1.0 to it (so pydantic's bool is true), 0.99999999999999994 is below 1.0.
        let object = JsonObject::parse(
            br#"{"a":1.00000000000000011,"b":0.99999999999999994,"c":1.0000000000000000000000000001,"d":100000000000000000011e-20}"#,
        )
        .unwrap();
        assert!(object.is_true("a"));
        assert!(!object.is_true("b"));
        assert!(object.is_true("c"));
        assert!(object.is_true("d"));
        assert_eq!(number(b"-1.00000000000000011"), Some(-1.0));
        assert_eq!(number(b"0.99999999999999994"), Some(0.9999999999999999));
        assert_eq!(number(b"1e400"), Some(f64::INFINITY));
        assert_eq!(number(b"-Infinity"), Some(f64::NEG_INFINITY));
        assert!(number(b"NaN").is_some_and(f64::is_nan));
        for not_a_number in [&b"\"1\""[..], b"true", b"null", b"[1]", b"inf", b"", b"+1"] {
            assert_eq!(number(not_a_number), None, "{not_a_number:?}");
        }
    }

    #[test]
    fn the_slot_is_filled_when_written() {
        let object = JsonObject::parse(br#"{"a":1}"#).unwrap();
        let splice = object.splice(|_| Edit::Slot, &[]);
        assert!(splice.has_slot());
        assert_eq!(splice.len(3), 9);
        assert_eq!(splice.write(br#"{"a":1}"#, b"[0]"), br#"{"a":[0]}"#);
        let kept = object.splice(|_| Edit::Keep, &[]);
        assert!(!kept.has_slot());
    }
}
