//! The CPU backend's workers: threads that stay awake a short while after each job, so a call
//! that follows another (a model's next layer, a benchmark's next repetition) starts all of its
//! tasks at once instead of waking a sleeping pool one thread at a time.
//!
//! [`broadcast`] runs a closure once per task index on the calling thread and `tasks - 1`
//! workers. The pool's threads are started the first time they are needed, one fewer than the
//! machine's cores; a call that asks for more tasks than that, or that finds the pool busy (a
//! second caller at the same time, or a nested call), runs its tasks on rayon's pool instead, so
//! a call never waits for another. Which thread runs which task never changes a result: callers
//! hand out work items from a shared counter and every item's values are computed the same way
//! wherever it runs.
//!
//! (OpenMP pools behave the same way: libgomp's threads spin for a while after a parallel region
//! before they sleep. Measured on the 16-core Xeon, session 47; `docs/cpu-performance.md`.)

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long a worker (and a caller waiting for its workers) spins before it sleeps, in
/// microseconds, unless `FLASH_ATTN_CPU_SPIN_US` says otherwise.
const DEFAULT_SPIN_US: u64 = 300;

/// The spin time: `FLASH_ATTN_CPU_SPIN_US` (whole microseconds; 0 sleeps at once) where it is
/// set to a number, else [`DEFAULT_SPIN_US`]. Read once, when the pool starts.
fn spin_from_env() -> Duration {
    spin_from(std::env::var("FLASH_ATTN_CPU_SPIN_US").ok().as_deref())
}

/// The spin time a value of `FLASH_ATTN_CPU_SPIN_US` asks for (anything but a whole number of
/// microseconds keeps the default).
fn spin_from(value: Option<&str>) -> Duration {
    let us = value.and_then(|v| v.trim().parse::<u64>().ok());
    Duration::from_micros(us.unwrap_or(DEFAULT_SPIN_US))
}

/// Checks of the job word between two looks at the clock while spinning.
const CHECKS_PER_CLOCK: u32 = 64;

/// Task counts (workers + 1 at most) are packed into the low bits of the job word, so a pool has
/// at most `2^TASK_BITS - 2` workers.
const TASK_BITS: u32 = 16;

/// The closure of the job in flight, with its lifetime erased (see [`broadcast`]'s SAFETY).
type Job = *const (dyn Fn(usize) + Sync);

/// What the caller and the workers share.
struct State {
    /// How long to spin before sleeping.
    spin: Duration,
    /// `(epoch << TASK_BITS) | tasks` of the latest job: a worker runs a job when this changes
    /// and its index is below `tasks`.
    word: AtomicU64,
    /// The latest job's closure; written only by a caller holding [`Pool::busy`] while no worker
    /// runs a job, read by workers after they load a new `word` (Acquire).
    job: UnsafeCell<Option<Job>>,
    /// Workers of the current job that have not finished it.
    remaining: AtomicUsize,
    /// Workers asleep on `wake` (or about to be).
    sleepers: AtomicUsize,
    /// The caller is asleep on `done` (or about to be).
    caller_asleep: AtomicBool,
    /// A worker's task panicked in the current job; its payload waits in `panic`.
    panicked: AtomicBool,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    lock: Mutex<()>,
    wake: Condvar,
    done: Condvar,
}

// SAFETY: every field but `job` is Sync; `job` is written only by the one caller holding
// `Pool::busy` while `remaining` is 0 (no worker reads it then), and read by workers only between
// an Acquire load of the `word` that the caller's Release store published after the write and
// their Release decrement of `remaining`, which that caller Acquires before it clears `job` and
// releases `busy` (the next caller's write comes after it takes `busy`).
unsafe impl Sync for State {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for State {}

/// The lazily started pool.
struct Pool {
    /// Worker threads (task indices 1..=workers; the caller is task 0).
    workers: usize,
    /// Held by the caller of the job in flight.
    busy: Mutex<()>,
    /// The process that started the workers: a child forked from it has none of them.
    pid: u32,
    state: Arc<State>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a task panicked while another thread held it; the data it
    // guards (nothing, or a panic payload) is still valid.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let want = (cores - 1).min((1 << TASK_BITS) - 2);
        let state = Arc::new(State {
            spin: spin_from_env(),
            word: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            caller_asleep: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            panic: Mutex::new(None),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let mut workers = 0;
        for index in 1..=want {
            let st = Arc::clone(&state);
            let spawned =
                std::thread::Builder::new().name(format!("flash-attn-{index}")).spawn(move || worker(&st, index));
            if spawned.is_err() {
                // Fewer workers than cores: calls that want more tasks use rayon.
                break;
            }
            workers += 1;
        }
        Pool { workers, busy: Mutex::new(()), pid: std::process::id(), state }
    })
}

/// Waits until `ready()` holds: spins (yielding the core now and then) for up to `st.spin`, then
/// sleeps on `cv`, announced through `asleep` so the waker knows to take the lock.
fn wait_until(st: &State, ready: impl Fn() -> bool, asleep: impl Fn(bool), cv: &Condvar) {
    let start = Instant::now();
    loop {
        for _ in 0..CHECKS_PER_CLOCK {
            if ready() {
                return;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= st.spin {
            break;
        }
        std::thread::yield_now();
    }
    let mut guard = lock(&st.lock);
    asleep(true);
    while !ready() {
        guard = cv.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
    asleep(false);
}

fn worker(st: &State, index: usize) {
    let mut seen = 0u64;
    loop {
        wait_until(
            st,
            || st.word.load(Ordering::SeqCst) != seen,
            |on| {
                if on {
                    st.sleepers.fetch_add(1, Ordering::SeqCst);
                } else {
                    st.sleepers.fetch_sub(1, Ordering::SeqCst);
                }
            },
            &st.wake,
        );
        seen = st.word.load(Ordering::Acquire);
        let tasks = (seen & ((1 << TASK_BITS) - 1)) as usize;
        if index >= tasks {
            continue;
        }
        // SAFETY: this worker is a participant of the job `seen` names, so the caller cannot
        // write `job` again (or return, ending the closure's borrow) before the decrement below.
        let job = unsafe { *st.job.get() };
        if let Some(job) = job {
            // SAFETY: as above, the closure outlives this call.
            let f = unsafe { &*job };
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(index))) {
                *lock(&st.panic) = Some(payload);
                st.panicked.store(true, Ordering::SeqCst);
            }
        }
        if st.remaining.fetch_sub(1, Ordering::SeqCst) == 1 && st.caller_asleep.load(Ordering::SeqCst) {
            let _guard = lock(&st.lock);
            st.done.notify_all();
        }
    }
}

/// Runs `f(0)`, `f(1)`, …, `f(tasks - 1)` concurrently, `f(0)` on the calling thread, and
/// returns when all have returned. A panic in any task is resumed on the caller after all tasks
/// have finished (the caller's payload first, else one worker's). Tasks must not wait for one
/// another: in a process forked from the one that started the workers (which has none of them)
/// the tasks run one after another on the caller, and a panic there ends the call at once.
pub(crate) fn broadcast(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 {
        if tasks == 1 {
            f(0);
        }
        return;
    }
    let pool = pool();
    if pool.pid != std::process::id() {
        (0..tasks).for_each(f);
        return;
    }
    let busy = match pool.busy.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    };
    let Some(_busy) = busy.filter(|_| tasks <= pool.workers + 1) else {
        rayon::scope(|scope| {
            for i in 0..tasks {
                scope.spawn(move |_| f(i));
            }
        });
        return;
    };
    let st = &*pool.state;
    let borrowed: *const (dyn Fn(usize) + Sync + '_) = f;
    // SAFETY: the lifetime of `f` is erased so the workers can reach it; they call it only while
    // they are counted in `remaining`, and this function does not return (nor unwind: `f(0)` is
    // caught) before `remaining` is 0, so `f` outlives every use. No worker reads `job` now:
    // the previous job's `remaining` reached 0 before its caller released `busy`.
    unsafe { *st.job.get() = Some(std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(borrowed)) };
    st.remaining.store(tasks - 1, Ordering::SeqCst);
    let epoch = (st.word.load(Ordering::Relaxed) >> TASK_BITS) + 1;
    st.word.store((epoch << TASK_BITS) | tasks as u64, Ordering::SeqCst);
    if st.sleepers.load(Ordering::SeqCst) > 0 {
        let _guard = lock(&st.lock);
        st.wake.notify_all();
    }
    let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
    wait_until(
        st,
        || st.remaining.load(Ordering::SeqCst) == 0,
        |on| st.caller_asleep.store(on, Ordering::SeqCst),
        &st.done,
    );
    // SAFETY: every worker of this job has finished with it.
    unsafe { *st.job.get() = None };
    let theirs = st.panicked.swap(false, Ordering::SeqCst).then(|| lock(&st.panic).take()).flatten();
    if let Err(payload) = mine {
        resume_unwind(payload);
    }
    if let Some(payload) = theirs {
        resume_unwind(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spin_time_comes_from_whole_microseconds_or_the_default() {
        assert_eq!(spin_from(Some("0")), Duration::ZERO);
        assert_eq!(spin_from(Some(" 1500 ")), Duration::from_micros(1500));
        for bad in [None, Some(""), Some("-3"), Some("2ms"), Some("1.5")] {
            assert_eq!(spin_from(bad), Duration::from_micros(DEFAULT_SPIN_US), "{bad:?}");
        }
    }

    #[test]
    fn every_task_runs_once_whatever_the_count_and_pool() {
        for tasks in [0usize, 1, 2, 3, 7, 64] {
            for _ in 0..50 {
                let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                broadcast(tasks, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "tasks {tasks}");
            }
        }
    }

    #[test]
    fn concurrent_and_nested_callers_each_finish() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        broadcast(2, &|_| {
                            broadcast(2, &|_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 100 * 2 * 2);
    }

    #[test]
    fn a_task_that_panics_reaches_the_caller_after_the_others_finish() {
        let finished = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            broadcast(2, &|i| {
                if i == 1 {
                    panic!("task one");
                }
                std::thread::sleep(Duration::from_millis(5));
                finished.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert!(r.is_err());
        assert_eq!(finished.load(Ordering::SeqCst), 1);
        // The pool still works afterwards.
        let n = AtomicUsize::new(0);
        broadcast(2, &|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }
}
