//! The module's proxy-wasm exports (ABI 0.2.1) and the registry that routes them to the
//! filter's contexts ([`Root`], [`Stream`]).
//!
//! Envoy calls back into the module from inside some host calls, while one of its callbacks
//! still runs: a request body grown past Envoy's buffer limit by `proxy_set_buffer_bytes`
//! makes Envoy answer the client (413) or reset the stream right there, and it then calls
//! the request's response callbacks, `proxy_on_done` and `proxy_on_delete` before the host
//! call returns. So the registry holds no borrow of its own while a callback runs, and a
//! context whose callback is already running (borrowed) is never entered twice: its stream
//! callbacks answer `Continue` without it, and `on_done` / `on_delete` are carried out as
//! soon as the outermost callback has returned (before the module answers Envoy's call), so
//! that the request still sees its end.
//!
//! The module exports no `proxy_on_log`: the filter keeps no access log of its own, and
//! Envoy skips the call into the VM for a module without it.
//!
//! A call's answer goes to the context whose callback sent it ([`http_call`]), the root or a
//! request, with that context made the effective one.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
#[cfg(not(test))]
use std::time::Duration;

#[cfg(not(test))]
use crate::host;

/// A stream callback's answer to Envoy.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Action {
    Continue = 0,
    Pause = 1,
}

/// A plugin's root context: one per plugin and VM.
pub trait Root {
    fn on_configure(&mut self, configuration_size: usize) -> bool;
    fn on_tick(&mut self);
    fn on_queue_ready(&mut self, queue_id: u32);
    fn on_http_call_response(&mut self, token: u32, body_size: usize);
    /// `false`: the root lives on until it calls the host's `proxy_done`.
    fn on_done(&mut self) -> bool;
    /// The context of a new HTTP stream of this plugin.
    fn create_http_context(&self, context_id: u32) -> Box<dyn Stream>;
}

/// An HTTP stream's context.
pub trait Stream {
    fn on_request_headers(&mut self, end_of_stream: bool) -> Action;
    fn on_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
    fn on_request_trailers(&mut self) -> Action {
        Action::Continue
    }
    fn on_response_headers(&mut self, _end_of_stream: bool) -> Action {
        Action::Continue
    }
    fn on_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
    fn on_response_trailers(&mut self) -> Action {
        Action::Continue
    }
    fn on_http_call_response(&mut self, _token: u32, _body_size: usize) {}
    fn on_done(&mut self) {}
}

/// How the filter makes a root context, given its id.
type NewRoot = fn(u32) -> Box<dyn Root>;
/// The context of a stream its root cannot make (the root unknown, or in a callback): one
/// that answers the client itself, so that no request goes on without the filter.
type NewUnserved = fn() -> Box<dyn Stream>;
type RootCell = Rc<RefCell<Box<dyn Root>>>;
type StreamCell = Rc<RefCell<Box<dyn Stream>>>;

#[derive(Clone)]
enum Context {
    Root(RootCell),
    Stream(StreamCell),
}

/// What waits for the outermost callback to return.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Deferred {
    Done(u32),
    Delete(u32),
}

#[derive(Default)]
struct Registry {
    new_root: Cell<Option<NewRoot>>,
    new_unserved: Cell<Option<NewUnserved>>,
    contexts: RefCell<HashMap<u32, Context>>,
    /// The context that sent each call still unanswered, by the host's token.
    calls: RefCell<HashMap<u32, u32>>,
    /// The context whose callback runs innermost (0: none).
    active: Cell<u32>,
    /// How many callbacks run, one inside the other.
    depth: Cell<u32>,
    deferred: RefCell<VecDeque<Deferred>>,
    draining: Cell<bool>,
}

thread_local! {
    static REGISTRY: Registry = Registry::default();
}

/// Sets how root contexts are made, and the streams no root can make; called once, when
/// the VM starts.
pub fn set_factories(new_root: NewRoot, new_unserved: NewUnserved) {
    REGISTRY.with(|registry| {
        registry.new_root.set(Some(new_root));
        registry.new_unserved.set(Some(new_unserved));
    });
}

/// Sends an HTTP call as the context whose callback runs: its answer comes to that context.
#[cfg(not(test))]
pub fn http_call(
    cluster: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, u32> {
    let token = host::http_call(cluster, headers, body, timeout)?;
    call_sent(token);
    Ok(token)
}

/// The call `token` went out in the callback that runs: its answer goes to that context.
fn call_sent(token: u32) {
    REGISTRY.with(|registry| {
        let sender = registry.active.get();
        registry.calls.borrow_mut().insert(token, sender);
    });
}

/// Makes `context_id` the one the next host calls act on.
#[cfg(not(test))]
fn make_effective(context_id: u32) {
    let _ = host::set_effective_context(context_id);
}

#[cfg(test)]
fn make_effective(context_id: u32) {
    tests::effective(context_id);
}

fn context(context_id: u32) -> Option<Context> {
    REGISTRY.with(|registry| registry.contexts.borrow().get(&context_id).cloned())
}

fn stream(context_id: u32) -> Option<StreamCell> {
    match context(context_id) {
        Some(Context::Stream(stream)) => Some(stream),
        _ => None,
    }
}

fn root(context_id: u32) -> Option<RootCell> {
    match context(context_id) {
        Some(Context::Root(root)) => Some(root),
        _ => None,
    }
}

/// Runs `callback` as one of `context_id`'s, then, once the outermost callback has returned,
/// what was deferred meanwhile. Whatever `callback` borrows it gives back before that.
fn run<T>(context_id: u32, callback: impl FnOnce() -> T) -> T {
    let (was_active, depth) = REGISTRY.with(|registry| {
        let depth = registry.depth.get();
        registry.depth.set(depth.saturating_add(1));
        (registry.active.replace(context_id), depth)
    });
    let result = callback();
    REGISTRY.with(|registry| {
        registry.active.set(was_active);
        registry.depth.set(depth);
    });
    if depth == 0 {
        run_deferred();
    }
    result
}

fn run_deferred() {
    let already = REGISTRY.with(|registry| registry.draining.replace(true));
    if already {
        return;
    }
    loop {
        let next = REGISTRY.with(|registry| registry.deferred.borrow_mut().pop_front());
        match next {
            Some(Deferred::Done(context_id)) => {
                // Envoy's current context may be another's (the root's): act on this one.
                make_effective(context_id);
                done(context_id);
            }
            Some(Deferred::Delete(context_id)) => delete(context_id),
            None => break,
        }
    }
    REGISTRY.with(|registry| registry.draining.set(false));
}

fn defer(what: Deferred) {
    REGISTRY.with(|registry| registry.deferred.borrow_mut().push_back(what));
}

fn is_deferred(context_id: u32) -> bool {
    REGISTRY.with(|registry| {
        registry
            .deferred
            .borrow()
            .iter()
            .any(|&what| what == Deferred::Done(context_id) || what == Deferred::Delete(context_id))
    })
}

/// Runs a stream callback; `unserved` is the answer when the stream's context is unknown or
/// already in a callback: `Pause` on the request's side, so that no request goes on without
/// the filter, `Continue` on the answer's, so that Envoy's own answer reaches the client.
fn on_stream(
    context_id: u32,
    unserved: Action,
    callback: impl FnOnce(&mut dyn Stream) -> Action,
) -> u32 {
    let Some(stream) = stream(context_id) else {
        return unserved as u32;
    };
    let action = run(context_id, move || match stream.try_borrow_mut() {
        Ok(mut stream) => callback(&mut **stream),
        Err(_) => unserved,
    });
    action as u32
}

/// Runs a root callback; `None` when the root is unknown or already in one.
fn on_root<T>(context_id: u32, callback: impl FnOnce(&mut dyn Root) -> T) -> Option<T> {
    let root = root(context_id)?;
    run(context_id, move || match root.try_borrow_mut() {
        Ok(mut root) => Some(callback(&mut **root)),
        Err(_) => None,
    })
}

/// `on_done`: `false` only for a root that lives on until it calls `proxy_done`.
fn done(context_id: u32) -> bool {
    match context(context_id) {
        Some(Context::Stream(stream)) => {
            let ran = run(context_id, || match stream.try_borrow_mut() {
                Ok(mut stream) => {
                    stream.on_done();
                    true
                }
                Err(_) => false,
            });
            if !ran {
                defer(Deferred::Done(context_id));
            }
            true
        }
        Some(Context::Root(_)) => match on_root(context_id, |root| root.on_done()) {
            Some(done) => done,
            None => {
                defer(Deferred::Done(context_id));
                true
            }
        },
        None => true,
    }
}

fn delete(context_id: u32) {
    let busy = match context(context_id) {
        Some(Context::Stream(stream)) => stream.try_borrow_mut().is_err(),
        Some(Context::Root(root)) => root.try_borrow_mut().is_err(),
        None => return,
    };
    if busy || is_deferred(context_id) {
        defer(Deferred::Delete(context_id));
        return;
    }
    let removed = REGISTRY.with(|registry| registry.contexts.borrow_mut().remove(&context_id));
    // Dropped here, after the registry's borrow: a context's drop may call the host.
    drop(removed);
}

/// Whether an ABI word says true.
fn flag(word: u32) -> bool {
    word != 0
}

fn size(word: u32) -> usize {
    usize::try_from(word).unwrap_or(usize::MAX)
}

#[cfg(all(target_os = "wasi", not(test)))]
extern "C" {
    fn __wasm_call_ctors();
}

/// The WASI reactor's start: Envoy calls it once, when it loads the module.
#[cfg(not(test))]
#[no_mangle]
pub extern "C" fn _initialize() {
    // SAFETY: the linker's constructors, run once, before anything else in the module.
    #[cfg(target_os = "wasi")]
    unsafe {
        __wasm_call_ctors();
    }
    crate::filter::start();
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory the host writes into and hands over: exactly `size` bytes from the global
/// allocator, laid out as a `Vec<u8>` of capacity `size` ([`crate::host`] takes them back as
/// one). Null when there is no room, a dangling (never read) pointer for zero bytes.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: u32) -> *mut u8 {
    let size = self::size(size);
    if size == 0 {
        return std::ptr::NonNull::<u8>::dangling().as_ptr();
    }
    match std::alloc::Layout::array::<u8>(size) {
        // SAFETY: a layout of non-zero size.
        Ok(layout) => unsafe { std::alloc::alloc(layout) },
        Err(_) => std::ptr::null_mut(),
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_id: u32) {
    if parent_id == 0 {
        let Some(new_root) = REGISTRY.with(|registry| registry.new_root.get()) else {
            return;
        };
        let root: RootCell = Rc::new(RefCell::new(new_root(context_id)));
        REGISTRY.with(|registry| {
            registry
                .contexts
                .borrow_mut()
                .insert(context_id, Context::Root(root))
        });
        return;
    }
    let made_by_root = root(parent_id).and_then(|parent| {
        let parent = parent.try_borrow().ok()?;
        Some(parent.create_http_context(context_id))
    });
    let unserved = || {
        REGISTRY
            .with(|registry| registry.new_unserved.get())
            .map(|new| new())
    };
    let Some(created) = made_by_root.or_else(unserved) else {
        return;
    };
    let stream: StreamCell = Rc::new(RefCell::new(created));
    REGISTRY.with(|registry| {
        registry
            .contexts
            .borrow_mut()
            .insert(context_id, Context::Stream(stream))
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_id: u32, _vm_configuration_size: u32) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, configuration_size: u32) -> u32 {
    let configured = on_root(root_id, |root| root.on_configure(size(configuration_size)));
    u32::from(configured.unwrap_or(false))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    let _ = on_root(root_id, |root| root.on_tick());
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(root_id: u32, queue_id: u32) {
    let _ = on_root(root_id, |root| root.on_queue_ready(queue_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    context_id: u32,
    _headers: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, Action::Pause, |stream| {
        stream.on_request_headers(flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(
    context_id: u32,
    body_size: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, Action::Pause, |stream| {
        stream.on_request_body(size(body_size), flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _trailers: u32) -> u32 {
    on_stream(context_id, Action::Pause, |stream| {
        stream.on_request_trailers()
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    _headers: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, Action::Continue, |stream| {
        stream.on_response_headers(flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(
    context_id: u32,
    body_size: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, Action::Continue, |stream| {
        stream.on_response_body(size(body_size), flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context_id: u32, _trailers: u32) -> u32 {
    on_stream(context_id, Action::Continue, |stream| {
        stream.on_response_trailers()
    })
}

/// A call's answer, for the context that sent it; dropped when that context is gone (or,
/// which Envoy does not do, already in a callback: the answer is readable only now).
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    _root_id: u32,
    token: u32,
    _headers: u32,
    body_size: u32,
    _trailers: u32,
) {
    let Some(sender) = REGISTRY.with(|registry| registry.calls.borrow_mut().remove(&token)) else {
        return;
    };
    let body_size = size(body_size);
    match context(sender) {
        Some(Context::Root(_)) => {
            make_effective(sender);
            let _ = on_root(sender, |root| root.on_http_call_response(token, body_size));
        }
        Some(Context::Stream(_)) => {
            make_effective(sender);
            let _ = on_stream(sender, Action::Continue, |stream| {
                stream.on_http_call_response(token, body_size);
                Action::Continue
            });
        }
        None => {}
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    u32::from(done(context_id))
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    delete(context_id);
}

#[cfg(test)]
mod tests {
    //! Envoy's calls, made as Envoy 1.40 makes them, nested ones included.

    use super::*;

    thread_local! {
        /// What the contexts saw, in order.
        static EVENTS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
        /// What a stream's request-body callback does inside itself, as Envoy would from
        /// inside a host call.
        static INSIDE_BODY: Cell<Option<fn(u32)>> = const { Cell::new(None) };
        static INSIDE_QUEUE_READY: Cell<Option<fn(u32)>> = const { Cell::new(None) };
    }

    pub(super) fn effective(context_id: u32) {
        event(format!("effective {context_id}"));
    }

    fn event(what: String) {
        EVENTS.with(|events| events.borrow_mut().push(what));
    }

    fn events() -> Vec<String> {
        EVENTS.with(|events| std::mem::take(&mut *events.borrow_mut()))
    }

    const ROOT: u32 = 1;
    const REQUEST: u32 = 2;
    const OTHER: u32 = 3;

    struct TestRoot(u32);

    impl Root for TestRoot {
        fn on_configure(&mut self, _configuration_size: usize) -> bool {
            true
        }

        fn on_tick(&mut self) {}

        fn on_queue_ready(&mut self, queue_id: u32) {
            event(format!("root queue {queue_id}"));
            if let Some(inside) = INSIDE_QUEUE_READY.get() {
                inside(queue_id);
            }
            event(format!("root queue {queue_id} returns"));
        }

        fn on_http_call_response(&mut self, token: u32, body_size: usize) {
            event(format!("root answer {token} {body_size}"));
        }

        fn on_done(&mut self) -> bool {
            event(format!("root {} done", self.0));
            true
        }

        fn create_http_context(&self, context_id: u32) -> Box<dyn Stream> {
            Box::new(TestStream(context_id))
        }
    }

    struct TestStream(u32);

    impl Stream for TestStream {
        fn on_request_headers(&mut self, _end_of_stream: bool) -> Action {
            event(format!("{} request headers", self.0));
            Action::Pause
        }

        fn on_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
            event(format!("{} request body", self.0));
            if let Some(inside) = INSIDE_BODY.get() {
                inside(self.0);
            }
            event(format!("{} request body returns", self.0));
            Action::Pause
        }

        fn on_response_headers(&mut self, _end_of_stream: bool) -> Action {
            event(format!("{} response headers", self.0));
            Action::Pause
        }

        fn on_http_call_response(&mut self, token: u32, body_size: usize) {
            event(format!("{} answer {token} {body_size}", self.0));
        }

        fn on_done(&mut self) {
            event(format!("{} done", self.0));
        }
    }

    /// What the filter makes for a stream its root cannot: it answers the client itself.
    struct Unserved;

    impl Stream for Unserved {
        fn on_request_headers(&mut self, _end_of_stream: bool) -> Action {
            event("unserved request headers".to_owned());
            Action::Pause
        }
    }

    /// A root and one request of it, as Envoy creates them.
    fn started() {
        set_factories(|root_id| Box::new(TestRoot(root_id)), || Box::new(Unserved));
        proxy_on_context_create(ROOT, 0);
        assert_eq!(proxy_on_configure(ROOT, 0), 1);
        proxy_on_context_create(REQUEST, ROOT);
        proxy_on_context_create(OTHER, ROOT);
        assert_eq!(
            proxy_on_request_headers(REQUEST, 3, 0),
            Action::Pause as u32
        );
        assert_eq!(events(), ["2 request headers"]);
    }

    /// Envoy's local reply from inside a host call of the request's, then the stream's end.
    fn envoy_ends_the_stream(context_id: u32) {
        let answer = proxy_on_response_headers(context_id, 1, 1);
        event(format!("nested response headers: {answer}"));
        assert_eq!(proxy_on_done(context_id), 1);
        proxy_on_delete(context_id);
        event("host call returns".to_owned());
    }

    #[test]
    fn a_stream_ended_inside_its_own_callback_ends_once_the_callback_returned() {
        started();
        INSIDE_BODY.set(Some(envoy_ends_the_stream));
        assert_eq!(proxy_on_request_body(REQUEST, 10, 1), Action::Pause as u32);
        assert_eq!(
            events(),
            [
                "2 request body",
                // Not entered again: Continue, and its end waits.
                "nested response headers: 0",
                "host call returns",
                "2 request body returns",
                "effective 2",
                "2 done",
            ]
        );
        // Deleted: Envoy's later calls for it reach nothing, and pass nothing on.
        assert_eq!(proxy_on_request_body(REQUEST, 10, 1), Action::Pause as u32);
        assert!(events().is_empty());
        // The others are untouched.
        assert_eq!(proxy_on_request_headers(OTHER, 1, 1), Action::Pause as u32);
        assert_eq!(events(), ["3 request headers"]);
    }

    #[test]
    fn a_stream_ended_inside_a_callback_of_the_root_ends_at_once() {
        started();
        INSIDE_QUEUE_READY.set(Some(|_| envoy_ends_the_stream(REQUEST)));
        proxy_on_queue_ready(ROOT, 7);
        assert_eq!(
            events(),
            [
                "root queue 7",
                "2 response headers",
                "nested response headers: 1",
                "2 done",
                "host call returns",
                "root queue 7 returns",
            ]
        );
        assert_eq!(proxy_on_request_body(REQUEST, 1, 1), Action::Pause as u32);
        assert!(events().is_empty());
    }

    #[test]
    fn a_request_callback_of_a_stream_already_in_one_lets_nothing_through() {
        started();
        INSIDE_BODY.set(Some(|context_id| {
            let answer = proxy_on_request_body(context_id, 1, 1);
            event(format!("nested request body: {answer}"));
        }));
        proxy_on_request_body(REQUEST, 1, 0);
        assert_eq!(
            events(),
            [
                "2 request body",
                "nested request body: 1",
                "2 request body returns"
            ]
        );
    }

    #[test]
    fn a_stream_its_root_cannot_make_is_never_passed_on_without_the_filter() {
        started();
        const LATE: u32 = 7;
        INSIDE_QUEUE_READY.set(Some(|_| proxy_on_context_create(LATE, ROOT)));
        proxy_on_queue_ready(ROOT, 1);
        proxy_on_context_create(8, 99);
        events();
        for stream in [LATE, 8] {
            assert_eq!(proxy_on_request_headers(stream, 1, 0), Action::Pause as u32);
        }
        assert_eq!(
            events(),
            ["unserved request headers", "unserved request headers"]
        );
    }

    #[test]
    fn a_root_already_in_a_callback_is_not_entered_again() {
        started();
        INSIDE_QUEUE_READY.set(Some(|queue| {
            if queue == 1 {
                proxy_on_queue_ready(ROOT, 2);
                proxy_on_tick(ROOT);
            }
        }));
        proxy_on_queue_ready(ROOT, 1);
        assert_eq!(events(), ["root queue 1", "root queue 1 returns"]);
        // A request's callback may run one of the root's (the filter's prefill hand-over).
        INSIDE_BODY.set(Some(|_| proxy_on_queue_ready(ROOT, 3)));
        proxy_on_request_body(REQUEST, 1, 1);
        assert_eq!(
            events(),
            [
                "2 request body",
                "root queue 3",
                "root queue 3 returns",
                "2 request body returns"
            ]
        );
    }

    #[test]
    fn an_answer_goes_to_the_context_whose_callback_sent_the_call() {
        started();
        INSIDE_BODY.set(Some(|_| call_sent(10)));
        INSIDE_QUEUE_READY.set(Some(|_| call_sent(11)));
        proxy_on_request_body(REQUEST, 1, 1);
        proxy_on_queue_ready(ROOT, 1);
        // The root's call, sent from inside the request's callback, is the root's.
        INSIDE_BODY.set(Some(|_| proxy_on_queue_ready(ROOT, 2)));
        INSIDE_QUEUE_READY.set(Some(|queue| {
            if queue == 2 {
                call_sent(12);
            }
        }));
        proxy_on_request_body(OTHER, 1, 1);
        events();
        proxy_on_http_call_response(ROOT, 10, 0, 5, 0);
        proxy_on_http_call_response(ROOT, 11, 0, 6, 0);
        proxy_on_http_call_response(ROOT, 12, 0, 7, 0);
        // Answered once; unknown tokens reach nothing.
        proxy_on_http_call_response(ROOT, 10, 0, 5, 0);
        proxy_on_http_call_response(ROOT, 99, 0, 5, 0);
        assert_eq!(
            events(),
            [
                "effective 2",
                "2 answer 10 5",
                "effective 1",
                "root answer 11 6",
                "effective 1",
                "root answer 12 7",
            ]
        );
        // A request gone before its answer: the answer is dropped.
        INSIDE_BODY.set(Some(|_| call_sent(13)));
        proxy_on_request_body(OTHER, 1, 1);
        proxy_on_done(OTHER);
        proxy_on_delete(OTHER);
        events();
        proxy_on_http_call_response(ROOT, 13, 0, 1, 0);
        assert!(events().is_empty());
    }

    #[test]
    fn the_root_is_done_and_deleted() {
        started();
        assert_eq!(proxy_on_done(ROOT), 1);
        proxy_on_delete(ROOT);
        proxy_on_queue_ready(ROOT, 1);
        assert_eq!(events(), ["root 1 done"]);
        // A request of a deleted root is not passed on without the filter.
        proxy_on_context_create(9, ROOT);
        assert_eq!(proxy_on_request_headers(9, 1, 1), Action::Pause as u32);
        assert_eq!(events(), ["unserved request headers"]);
    }

    #[test]
    fn allocations_are_the_exact_size_the_host_asked_for() {
        for size in [0u32, 1, 17, 65_536] {
            let data = proxy_on_memory_allocate(size);
            assert!(!data.is_null());
            let len = usize::try_from(size).unwrap();
            // SAFETY: as `host` takes them back: a Vec of capacity `size`.
            let bytes = unsafe {
                std::ptr::write_bytes(data, 7, len);
                Vec::from_raw_parts(data, len, len)
            };
            assert!(bytes.iter().all(|&byte| byte == 7));
        }
    }
}
