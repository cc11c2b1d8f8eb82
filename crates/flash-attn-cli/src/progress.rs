//! Progress on stderr that appears only when work takes longer than a second, and never when
//! stderr is not a terminal (so scripts and tests see clean output).

use std::io::IsTerminal;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long work may run before progress is shown.
const SHOW_AFTER: Duration = Duration::from_secs(1);
/// Redraw interval once shown.
const TICK: Duration = Duration::from_millis(100);

/// A spinner or bar, hidden at first and made visible by a helper thread after [`SHOW_AFTER`];
/// cleared when dropped.
pub struct Progress {
    bar: ProgressBar,
    /// Dropping the sender tells the helper thread the work is done.
    done: Option<mpsc::Sender<()>>,
    helper: Option<JoinHandle<()>>,
}

impl Progress {
    /// A spinner with a message, for work of unknown length.
    pub fn spinner(msg: &str) -> Self {
        let bar = ProgressBar::hidden();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
            bar.set_style(style);
        }
        bar.set_message(msg.to_owned());
        Self::start(bar)
    }

    /// A bar over `len` steps.
    pub fn bar(len: u64, msg: &str) -> Self {
        let bar = ProgressBar::hidden();
        bar.set_length(len);
        if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed} (eta {eta})") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(msg.to_owned());
        Self::start(bar)
    }

    fn start(bar: ProgressBar) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self { bar, done: None, helper: None };
        }
        let (done, wait) = mpsc::channel::<()>();
        let shown = bar.clone();
        let helper = std::thread::Builder::new()
            .name("flash-attn-progress".into())
            .spawn(move || {
                if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(SHOW_AFTER) {
                    shown.set_draw_target(ProgressDrawTarget::stderr());
                    shown.enable_steady_tick(TICK);
                }
            })
            .ok();
        Self { bar, done: Some(done), helper }
    }

    /// Advances the bar by one step.
    pub fn inc(&self) {
        self.bar.inc(1);
    }

    /// Replaces the message next to the bar.
    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    /// Runs `f` with the bar cleared and its redraws held back: for printing to the terminal, and
    /// for memory measurements that the redraw thread's allocations must not disturb.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(helper) = self.helper.take() {
            let _ = helper.join();
        }
        self.bar.finish_and_clear();
    }
}
