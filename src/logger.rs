//! The filter's `log` backend: lines go to Envoy's log, at most `max_log_lines_per_second` a
//! second per worker at info and above (debug and trace, off unless Envoy's level asks for
//! them, are not counted), and as many again of the lines that say a worker's state changed
//! ([`crate::log_budget::EVENT_TARGET`]), which have a budget of their own. Every line is
//! written as one line ([`crate::log_budget::one_line`]).

use std::cell::RefCell;
use std::time::UNIX_EPOCH;

use crate::host::LogLevel;

use crate::host;
use crate::log_budget::{one_line, Admission, LogBudgets, LINES_PER_SECOND};

struct HostLogger;

static LOGGER: HostLogger = HostLogger;

thread_local! {
    static BUDGET: RefCell<LogBudgets> = const { RefCell::new(LogBudgets::new(LINES_PER_SECOND)) };
}

/// Makes this the `log` backend, at `level`, and panics (which would end the VM) logged.
pub fn install(level: LogLevel) {
    // Only the first call can succeed; a later one changes nothing.
    let _ = log::set_logger(&LOGGER);
    std::panic::set_hook(Box::new(|panic| {
        let _ = host::log(LogLevel::Critical, &one_line(&panic.to_string()));
    }));
    set_level(level);
}

/// At most `per_second` lines a second at info and above; 0: every line.
pub fn set_lines_per_second(per_second: u32) {
    BUDGET.with(|budget| {
        if let Ok(mut budget) = budget.try_borrow_mut() {
            *budget = LogBudgets::new(per_second);
        }
    });
}

/// Lines below `level` are not even formatted.
pub fn set_level(level: LogLevel) {
    log::set_max_level(match level {
        LogLevel::Trace => log::LevelFilter::Trace,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Critical => log::LevelFilter::Off,
    });
}

impl log::Log for HostLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => LogLevel::Trace,
            log::Level::Debug => LogLevel::Debug,
            log::Level::Info => LogLevel::Info,
            log::Level::Warn => LogLevel::Warn,
            log::Level::Error => LogLevel::Error,
        };
        // Only lines at info and above count; without the host's clock a line cannot be
        // counted against a second, and is written.
        let second = (record.level() <= log::Level::Info)
            .then(host::now)
            .and_then(Result::ok)
            .and_then(|now| now.duration_since(UNIX_EPOCH).ok())
            .map(|since| since.as_secs());
        if let Some(second) = second {
            let admission = BUDGET.with(|budget| {
                budget
                    .try_borrow_mut()
                    .map_or(Admission::Drop, |mut budget| {
                        budget.admit(record.level(), record.target(), second)
                    })
            });
            match admission {
                Admission::Drop => return,
                Admission::Write { not_written_before } if not_written_before > 0 => {
                    let _ = host::log(
                        LogLevel::Warn,
                        &format!(
                            "pd-filter: {not_written_before} log lines not written \
                             (max_log_lines_per_second)"
                        ),
                    );
                }
                Admission::Write { .. } => {}
            }
        }
        let _ = host::log(level, &one_line(&record.args().to_string()));
    }

    fn flush(&self) {}
}
