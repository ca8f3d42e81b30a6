//! How many lines a worker writes to Envoy's log: under overload every refused request has
//! a line to log, and Envoy would write tens of MB a minute. Each second takes a bounded
//! number; the rest are counted and the count is written with the next line let through.
//! And each line stays one line ([`one_line`]). A configuration's summary is written once
//! for the process, not by every worker's VM ([`announces_configuration`]).

use std::borrow::Cow;

/// Lines a worker writes per second, at most, by default (`max_log_lines_per_second`).
pub const LINES_PER_SECOND: u32 = 20;

/// The lines of the current second, and those not written since the last one that was.
#[derive(Debug)]
pub struct LogBudget {
    per_second: u32,
    second: u64,
    written: u32,
    not_written: u64,
}

/// Whether a line goes to the log.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Write it; `not_written_before` lines were dropped since the last one written.
    Write {
        not_written_before: u64,
    },
    Drop,
}

impl LogBudget {
    /// At most `per_second` lines a second; 0: every line.
    pub const fn new(per_second: u32) -> LogBudget {
        LogBudget {
            per_second,
            second: 0,
            written: 0,
            not_written: 0,
        }
    }

    /// A line at `second` (since the epoch) asks to be written.
    pub fn admit(&mut self, second: u64) -> Admission {
        if second != self.second {
            self.second = second;
            self.written = 0;
        }
        if self.per_second > 0 && self.written >= self.per_second {
            self.not_written = self.not_written.saturating_add(1);
            return Admission::Drop;
        }
        self.written = self.written.saturating_add(1);
        Admission::Write {
            not_written_before: std::mem::take(&mut self.not_written),
        }
    }
}

/// Target of the lines that say a worker's state changed (a decode pool refused, then served
/// again): rare, and what an operator reads first in an outage. They take a budget of their
/// own, so that a fault storm's per-request lines, which use up the ordinary budget every
/// second, cannot crowd them out.
pub const EVENT_TARGET: &str = "pd_filter::event";

/// A worker's three budgets: warnings and errors about a request (a worker failed, a KV
/// release was lost), info lines about a request (mostly one refused for what its own client
/// sent or did: prefill's 4xx, its 429 or 503), and [`EVENT_TARGET`]'s. Info lines have a
/// budget apart so that one client, whose refusals cost it nothing past the first few,
/// cannot crowd out the lines about other clients' failed requests an operator looks for.
#[derive(Debug)]
pub struct LogBudgets {
    lines: LogBudget,
    notices: LogBudget,
    events: LogBudget,
}

impl LogBudgets {
    /// At most `per_second` lines a second of each kind; 0: every line.
    pub const fn new(per_second: u32) -> LogBudgets {
        LogBudgets {
            lines: LogBudget::new(per_second),
            notices: LogBudget::new(per_second),
            events: LogBudget::new(per_second),
        }
    }

    /// A line at `level` of `target` at `second` (since the epoch) asks to be written.
    pub fn admit(&mut self, level: log::Level, target: &str, second: u64) -> Admission {
        if target == EVENT_TARGET {
            self.events.admit(second)
        } else if level >= log::Level::Info {
            self.notices.admit(second)
        } else {
            self.lines.admit(second)
        }
    }
}

/// `text` with every character that could end a line in Envoy's log, or be read as the
/// terminal's, escaped (`\n`, `\u{2028}`, `\u{1b}`). Lines quote what others wrote: prefill's
/// error message, which vLLM often writes with the client's own words in it (a model name, a
/// tool name), would otherwise let a client write whole lines of its own into the log, such
/// as a failure under another client's request id.
pub fn one_line(text: &str) -> Cow<'_, str> {
    fn breaks_line(c: char) -> bool {
        c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
    }
    if !text.chars().any(breaks_line) {
        return Cow::Borrowed(text);
    }
    let mut line = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if breaks_line(c) {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    Cow::Owned(line)
}

/// How long a configuration's announcement (its summary and warnings, once for the
/// process, not per worker VM) keeps other VMs that load it quiet: a push reaches every
/// worker within it, and the same configuration pushed again later, after another, is
/// announced again.
pub const ANNOUNCEMENT_WINDOW_SECONDS: u64 = 5;

/// Whether a VM that loads a configuration at `now_seconds` announces it, given when it was
/// last announced (decimal seconds, as the VMs share it); `None`: never.
pub fn announces_configuration(last_announced: Option<&[u8]>, now_seconds: u64) -> bool {
    let last = last_announced
        .and_then(|text| std::str::from_utf8(text).ok())
        .and_then(|text| text.parse::<u64>().ok());
    last.is_none_or(|last| now_seconds.saturating_sub(last) >= ANNOUNCEMENT_WINDOW_SECONDS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use log::Level;

    /// One client's refusals (info lines, as many as it sends requests) use up their budget
    /// every second; the warning about another client's failed prefill is still written.
    #[test]
    fn a_flood_of_refusals_does_not_crowd_out_warnings() {
        let mut budgets = LogBudgets::new(2);
        let written = Admission::Write {
            not_written_before: 0,
        };
        for _ in 0..50 {
            budgets.admit(Level::Info, "pd_filter::session::prefill", 10);
        }
        assert_eq!(
            budgets.admit(Level::Info, "pd_filter::session::intake", 10),
            Admission::Drop
        );
        assert_eq!(
            budgets.admit(Level::Warn, "pd_filter::session::prefill", 10),
            written
        );
        assert_eq!(
            budgets.admit(Level::Error, "pd_filter::filter", 10),
            written
        );
        // Warnings are bounded too, and each kind counts its own left out.
        assert_eq!(
            budgets.admit(Level::Warn, "pd_filter::filter", 10),
            Admission::Drop
        );
        assert_eq!(
            budgets.admit(Level::Warn, "pd_filter::filter", 11),
            Admission::Write {
                not_written_before: 1
            }
        );
        assert_eq!(
            budgets.admit(Level::Info, "pd_filter::session::prefill", 11),
            Admission::Write {
                not_written_before: 49
            }
        );
    }

    #[test]
    fn events_are_not_crowded_out_by_per_request_lines() {
        let mut budgets = LogBudgets::new(2);
        let written = Admission::Write {
            not_written_before: 0,
        };
        // A fault storm: every second's budget of per-request lines is used up.
        for _ in 0..50 {
            budgets.admit(Level::Warn, "pd_filter::session::answer", 10);
        }
        assert_eq!(
            budgets.admit(Level::Warn, "pd_filter::session::answer", 10),
            Admission::Drop
        );
        // The decode pool's outage, and its end, are still written.
        assert_eq!(budgets.admit(Level::Warn, EVENT_TARGET, 10), written);
        assert_eq!(budgets.admit(Level::Warn, EVENT_TARGET, 10), written);
        // Events are bounded too.
        assert_eq!(
            budgets.admit(Level::Warn, EVENT_TARGET, 10),
            Admission::Drop
        );
        assert_eq!(
            budgets.admit(Level::Error, "pd_filter::filter", 11),
            Admission::Write {
                not_written_before: 49
            }
        );
        assert_eq!(
            budgets.admit(Level::Warn, EVENT_TARGET, 11),
            Admission::Write {
                not_written_before: 1
            }
        );
    }

    #[test]
    fn each_second_writes_a_bounded_number_and_counts_the_rest() {
        let mut budget = LogBudget::new(2);
        let written = Admission::Write {
            not_written_before: 0,
        };
        assert_eq!(budget.admit(10), written);
        assert_eq!(budget.admit(10), written);
        assert_eq!(budget.admit(10), Admission::Drop);
        assert_eq!(budget.admit(10), Admission::Drop);
        // The next second's first line says how many were dropped.
        assert_eq!(
            budget.admit(11),
            Admission::Write {
                not_written_before: 2
            }
        );
        assert_eq!(budget.admit(11), written);
        assert_eq!(budget.admit(11), Admission::Drop);
        // Much later: the count still comes with the next line written.
        assert_eq!(
            budget.admit(500),
            Admission::Write {
                not_written_before: 1
            }
        );
        // No limit.
        let mut unlimited = LogBudget::new(0);
        for _ in 0..1000 {
            assert_eq!(unlimited.admit(7), written);
        }
    }

    #[test]
    fn a_quoted_message_stays_on_its_line() {
        let forged = "The tool `x`\n[warning] [victim] prefill failure\r\u{2028}\u{85}\u{1b}[2J`";
        let line = one_line(forged);
        assert_eq!(
            line,
            "The tool `x`\\n[warning] [victim] prefill failure\\r\\u{2028}\\u{85}\\u{1b}[2J`"
        );
        assert!(!line.chars().any(|c| c.is_control() || c == '\u{2028}'));
        let plain = "prefill refused the request: answering 400: ünïcode stays";
        assert!(matches!(one_line(plain), Cow::Borrowed(text) if text == plain));
    }

    #[test]
    fn a_configuration_is_announced_once_per_push_and_again_on_a_later_push() {
        assert!(announces_configuration(None, 100));
        // The other workers of the same push.
        assert!(!announces_configuration(Some(b"100"), 100));
        assert!(!announces_configuration(Some(b"100"), 104));
        // The same configuration pushed again later.
        assert!(announces_configuration(Some(b"100"), 105));
        // A clock that went back.
        assert!(!announces_configuration(Some(b"100"), 90));
        // What an older build stored.
        assert!(announces_configuration(Some(b"1"), 100));
        assert!(announces_configuration(Some(b"x"), 100));
    }
}
