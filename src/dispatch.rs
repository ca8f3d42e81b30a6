//! The module's proxy-wasm exports (ABI 0.2.1) and the registry that routes them to the
//! filter's contexts ([`Root`], [`Stream`]).
//!
//! Envoy calls back into the module from inside some host calls, while one of its callbacks
//! still runs: a request body grown past Envoy's buffer limit by `proxy_set_buffer_bytes`
//! makes Envoy answer the client (413) or reset the stream right there, and it then calls
//! the request's response callbacks, `proxy_on_log`, `proxy_on_done` and `proxy_on_delete`
//! before the host call returns. So the registry holds no borrow of its own while a callback
//! runs, and a context whose callback is already running (borrowed) is never entered twice:
//! its stream callbacks answer `Continue` without it, `on_log` does nothing, and `on_done` /
//! `on_delete` are carried out as soon as the outermost callback has returned (before the
//! module answers Envoy's call), so that the request still sees its end.
//!
//! A call's answer goes to the context whose callback sent it ([`http_call`]), the root or a
//! request, with that context made the effective one.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

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

/// Sets how root contexts are made; called once, when the VM starts.
pub fn set_root_factory(new_root: NewRoot) {
    REGISTRY.with(|registry| registry.new_root.set(Some(new_root)));
}

/// Sends an HTTP call as the context whose callback runs: its answer comes to that context.
pub fn http_call(
    cluster: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, u32> {
    let token = host::http_call(cluster, headers, body, timeout)?;
    REGISTRY.with(|registry| {
        let sender = registry.active.get();
        registry.calls.borrow_mut().insert(token, sender);
    });
    Ok(token)
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
                let _ = host::set_effective_context(context_id);
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

/// Runs a stream callback; `busy` when the stream's context is unknown or already in one.
fn on_stream(context_id: u32, callback: impl FnOnce(&mut dyn Stream) -> Action) -> u32 {
    let Some(stream) = stream(context_id) else {
        return Action::Continue as u32;
    };
    let action = run(context_id, move || match stream.try_borrow_mut() {
        Ok(mut stream) => callback(&mut **stream),
        Err(_) => Action::Continue,
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

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

/// The WASI reactor's start: Envoy calls it once, when it loads the module.
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
    let Some(parent) = root(parent_id) else {
        return;
    };
    let created = match parent.try_borrow() {
        Ok(parent) => parent.create_http_context(context_id),
        Err(_) => return,
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
    on_stream(context_id, |stream| {
        stream.on_request_headers(flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(
    context_id: u32,
    body_size: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, |stream| {
        stream.on_request_body(size(body_size), flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _trailers: u32) -> u32 {
    on_stream(context_id, |stream| stream.on_request_trailers())
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    _headers: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, |stream| {
        stream.on_response_headers(flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(
    context_id: u32,
    body_size: u32,
    end_of_stream: u32,
) -> u32 {
    on_stream(context_id, |stream| {
        stream.on_response_body(size(body_size), flag(end_of_stream))
    })
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(context_id: u32, _trailers: u32) -> u32 {
    on_stream(context_id, |stream| stream.on_response_trailers())
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
            let _ = host::set_effective_context(sender);
            let _ = on_root(sender, |root| root.on_http_call_response(token, body_size));
        }
        Some(Context::Stream(_)) => {
            let _ = host::set_effective_context(sender);
            let _ = on_stream(sender, |stream| {
                stream.on_http_call_response(token, body_size);
                Action::Continue
            });
        }
        None => {}
    }
}

/// The filter keeps no access log of its own.
#[no_mangle]
pub extern "C" fn proxy_on_log(_context_id: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    u32::from(done(context_id))
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    delete(context_id);
}
