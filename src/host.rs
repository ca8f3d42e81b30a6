//! The host calls that change a request or its answer, made through the proxy-wasm ABI
//! directly. The SDK's `hostcalls` wrappers panic on any status they do not expect (and a
//! panic kills the VM for every later request), while Envoy refuses these calls in states a
//! client can bring about: a body or header written after the stream moved on, a local reply
//! after the answer began. Here every refusal is a value, the host's status.

use proxy_wasm::types::{BufferType, MapType, StreamType};

#[link(wasm_import_module = "env")]
extern "C" {
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
    fn proxy_set_property(
        path: *const u8,
        path_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
}

/// The host's status: 0 is Ok, anything else a refusal.
fn result(status: u32) -> Result<(), u32> {
    match status {
        0 => Ok(()),
        status => Err(status),
    }
}

// SAFETY (every call below): each pointer and length describes a live byte slice for the
// whole call; the host copies what it reads and keeps no reference.

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

/// Answers the client from the filter.
pub fn send_reply(status: u16, headers: &[(String, String)], body: &[u8]) -> Result<(), u32> {
    let headers = serialize_headers(headers);
    result(unsafe {
        proxy_send_local_response(
            u32::from(status),
            std::ptr::null(),
            0,
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

/// Headers in the ABI's map form: their count, each name's and value's length, then each
/// name and value NUL-terminated (lengths little-endian u32).
fn serialize_headers(headers: &[(String, String)]) -> Vec<u8> {
    let size = 4 + headers
        .iter()
        .map(|(name, value)| 10 + name.len() + value.len())
        .sum::<usize>();
    let mut bytes = Vec::with_capacity(size);
    let length = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    bytes.extend_from_slice(&length(headers.len()));
    for (name, value) in headers {
        bytes.extend_from_slice(&length(name.len()));
        bytes.extend_from_slice(&length(value.len()));
    }
    for (name, value) in headers {
        bytes.extend_from_slice(name.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
    }
    bytes
}
