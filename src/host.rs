//! The proxy-wasm host calls the filter makes, through the ABI directly (ABI 0.2.1). A panic
//! kills the VM for every later request, while Envoy refuses calls in states a client can
//! bring about: a body or header written after the stream moved on, a local reply after the
//! answer began. Here every refusal is a value, the host's status, logging included. The
//! enums below are the ABI's numbers for the values the filter passes (only those it
//! passes).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::headers::HeaderMap;

/// A log line's level, as the ABI numbers them.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LogLevel {
    Trace = 0,
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
    Critical = 5,
}

/// The header maps the filter reads and writes (the ABI's names).
#[allow(clippy::enum_variant_names)]
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum MapType {
    HttpRequestHeaders = 0,
    HttpResponseHeaders = 2,
    HttpCallResponseHeaders = 6,
}

/// The buffers the filter reads and writes.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BufferType {
    HttpRequestBody = 0,
    HttpResponseBody = 1,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

/// The kinds of metric the filter defines.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum MetricType {
    Counter = 0,
    Histogram = 2,
}

/// The stream the filter resumes.
#[repr(u32)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum StreamType {
    HttpRequest = 0,
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: LogLevel, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        max_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_get_log_level(return_level: *mut u32) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_done() -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8,
        name_size: usize,
        arguments: *const u8,
        arguments_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_size: usize, return_id: *mut u32) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_data: *mut *mut u8,
        return_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        return_data: *mut *mut u8,
        return_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: MetricType,
        name: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: BufferType,
        start: usize,
        size: usize,
        data: *const u8,
        data_size: usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: MapType, key: *const u8, key_size: usize) -> u32;
    fn proxy_add_header_map_value(
        map_type: MapType,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_continue_stream(stream_type: StreamType) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_http_call(
        cluster: *const u8,
        cluster_size: usize,
        headers: *const u8,
        headers_size: usize,
        body: *const u8,
        body_size: usize,
        trailers: *const u8,
        trailers_size: usize,
        timeout_milliseconds: u32,
        return_token: *mut u32,
    ) -> u32;
    fn proxy_set_property(
        path: *const u8,
        path_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
}

/// Writes a line to Envoy's log.
pub fn log(level: LogLevel, message: &str) -> Result<(), u32> {
    result(unsafe { proxy_log(level, message.as_ptr(), message.len()) })
}

/// The host's status: 0 is Ok, anything else a refusal.
fn result(status: u32) -> Result<(), u32> {
    match status {
        0 => Ok(()),
        status => Err(status),
    }
}

/// The ABI's `NotFound` status: no such value (a property the stream does not have, an
/// empty buffer).
pub const NOT_FOUND: u32 = 1;

/// The ABI's `BadArgument` status: for a call, a cluster Envoy does not have.
pub const BAD_ARGUMENT: u32 = 2;

/// The ABI's `Empty` status: a queue with nothing in it.
const EMPTY: u32 = 7;

/// Takes the bytes the host wrote into memory it had the VM allocate
/// (`proxy_on_memory_allocate`, [`crate::dispatch`]: exactly `size` bytes, laid out as a
/// `Vec<u8>` whose capacity is `size`).
///
/// SAFETY: `data` is null, or the host's allocation of `size` bytes, handed over once.
unsafe fn take_host_bytes(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        Vec::from_raw_parts(data, size, size)
    }
}

/// Calls a host function that returns bytes, and takes them.
fn read(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Vec<u8>, u32> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    let status = call(&mut data, &mut size);
    // SAFETY: whatever the status, a non-null `data` is an allocation the host made for us.
    let bytes = unsafe { take_host_bytes(data, size) };
    result(status).map(|()| bytes)
}

// SAFETY (every call below): each pointer and length describes a live byte slice for the
// whole call; the host copies what it reads and keeps no reference.

/// A header map, read in one call.
pub fn header_map(map: MapType) -> Result<HeaderMap, u32> {
    read(|data, size| unsafe { proxy_get_header_map_pairs(map, data, size) })
        .map(HeaderMap::from_serialized)
}

/// Up to `max_size` bytes of a buffer from `start`.
pub fn buffer(buffer: BufferType, start: usize, max_size: usize) -> Result<Vec<u8>, u32> {
    read(|data, size| unsafe { proxy_get_buffer_bytes(buffer, start, max_size, data, size) })
}

/// A property (e.g. `["response", "code_details"]`).
pub fn property(path: &[&str]) -> Result<Vec<u8>, u32> {
    let path = path.join("\0");
    read(|data, size| unsafe { proxy_get_property(path.as_ptr(), path.len(), data, size) })
}

/// The host's wall clock.
pub fn now() -> Result<SystemTime, u32> {
    let mut nanos: u64 = 0;
    result(unsafe { proxy_get_current_time_nanoseconds(&mut nanos) })?;
    Ok(UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// The host's log level, as the ABI numbers it (0 trace to 5 critical).
pub fn log_level() -> Result<u32, u32> {
    let mut level: u32 = 0;
    result(unsafe { proxy_get_log_level(&mut level) })?;
    Ok(level)
}

/// How often the root's `on_tick` runs; zero stops it.
pub fn set_tick_period(period: Duration) -> Result<(), u32> {
    let millis = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    result(unsafe { proxy_set_tick_period_milliseconds(millis) })
}

/// Tells the host that the root context, which asked to outlive its plugin, has finished.
pub fn done() -> Result<(), u32> {
    result(unsafe { proxy_done() })
}

/// Makes a request's stream the one later calls act on.
pub fn set_effective_context(context_id: u32) -> Result<(), u32> {
    result(unsafe { proxy_set_effective_context(context_id) })
}

/// Calls a host extension without arguments; its result is not needed.
pub fn call_foreign_function(name: &str) -> Result<(), u32> {
    read(|data, size| unsafe {
        proxy_call_foreign_function(name.as_ptr(), name.len(), std::ptr::null(), 0, data, size)
    })
    .map(drop)
}

pub fn register_shared_queue(name: &str) -> Result<u32, u32> {
    let mut queue: u32 = 0;
    result(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut queue) })?;
    Ok(queue)
}

pub fn enqueue(queue: u32, value: &[u8]) -> Result<(), u32> {
    result(unsafe { proxy_enqueue_shared_queue(queue, value.as_ptr(), value.len()) })
}

/// The next item of a queue; `None` when it is empty.
pub fn dequeue(queue: u32) -> Result<Option<Vec<u8>>, u32> {
    match read(|data, size| unsafe { proxy_dequeue_shared_queue(queue, data, size) }) {
        Ok(item) => Ok(Some(item)),
        Err(EMPTY) => Ok(None),
        Err(status) => Err(status),
    }
}

/// The value of `key` in the data the plugin's VMs share; `None` where it has none.
pub fn shared_data(key: &str) -> Option<Vec<u8>> {
    let mut cas: u32 = 0;
    read(|data, size| unsafe {
        proxy_get_shared_data(key.as_ptr(), key.len(), data, size, &mut cas)
    })
    .ok()
}

/// Sets shared data `key`, whatever it held.
pub fn set_shared_data(key: &str, value: &[u8]) -> Result<(), u32> {
    result(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), 0)
    })
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, u32> {
    let mut id: u32 = 0;
    result(unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, offset: i64) -> Result<(), u32> {
    result(unsafe { proxy_increment_metric(id, offset) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
    result(unsafe { proxy_record_metric(id, value) })
}

/// Replaces `size` bytes of the buffer from `start` with `data`.
pub fn set_buffer(buffer: BufferType, start: usize, size: usize, data: &[u8]) -> Result<(), u32> {
    result(unsafe { proxy_set_buffer_bytes(buffer, start, size, data.as_ptr(), data.len()) })
}

/// Sets header `name` to `value`, or removes it when `value` is `None`.
pub fn set_header(map: MapType, name: &str, value: Option<&str>) -> Result<(), u32> {
    result(unsafe {
        match value {
            Some(value) => proxy_replace_header_map_value(
                map,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            ),
            None => proxy_remove_header_map_value(map, name.as_ptr(), name.len()),
        }
    })
}

pub fn add_header(map: MapType, name: &str, value: &str) -> Result<(), u32> {
    result(unsafe {
        proxy_add_header_map_value(map, name.as_ptr(), name.len(), value.as_ptr(), value.len())
    })
}

pub fn resume_request() -> Result<(), u32> {
    result(unsafe { proxy_continue_stream(StreamType::HttpRequest) })
}

/// Envoy's `response.code_details` of the filter's own answers: the shipped configurations'
/// `local_reply_config` passes these on as they are (they are already OpenAI errors) and
/// writes Envoy's own local replies in the same shape.
const REPLY_DETAILS: &str = "pd_filter";

/// Answers the client from the filter.
pub fn send_reply(status: u16, headers: &[(String, String)], body: &[u8]) -> Result<(), u32> {
    let headers = HeaderMap::serialize(headers);
    result(unsafe {
        proxy_send_local_response(
            u32::from(status),
            REPLY_DETAILS.as_ptr(),
            REPLY_DETAILS.len(),
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

/// Sets a one-segment property (a filter state key).
pub fn set_property(key: &str, value: &[u8]) -> Result<(), u32> {
    result(unsafe { proxy_set_property(key.as_ptr(), key.len(), value.as_ptr(), value.len()) })
}

/// Sends an HTTP call to `cluster` (no trailers); the host's token for its answer, which
/// comes to `proxy_on_http_call_response`. Envoy answers `BadArgument` for a cluster it does
/// not have, and `InternalFailure` for a call it refused at once.
pub fn http_call(
    cluster: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
) -> Result<u32, u32> {
    let headers = HeaderMap::serialize(headers);
    let no_trailers = HeaderMap::serialize::<&str, &str>(&[]);
    let millis = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    let mut token: u32 = 0;
    result(unsafe {
        proxy_http_call(
            cluster.as_ptr(),
            cluster.len(),
            headers.as_ptr(),
            headers.len(),
            body.as_ptr(),
            body.len(),
            no_trailers.as_ptr(),
            no_trailers.len(),
            millis,
            &mut token,
        )
    })?;
    Ok(token)
}
