//! A stand-in for a pd-filter whose VM crashed, for tests only (`tests/manifests.rs`): it
//! marks every request as pd-filter does (so that the guard lets it through), and traps on a
//! request carrying `x-crash-vm`, which kills the VM as a panic would.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request))
    }
}

struct Request;

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let _ = proxy_wasm::hostcalls::set_property(vec!["pd_filter_ran"], Some(b"yes"));
        let crash = proxy_wasm::hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-crash-vm");
        if let Ok(Some(_)) = crash {
            // A trap in the VM, as a panic of pd-filter's would be.
            std::process::abort();
        }
        Action::Continue
    }
}
