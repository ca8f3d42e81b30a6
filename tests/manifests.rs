//! The deployment files: the Istio manifests against the schema of Istio's `WasmPlugin` (stated
//! in this file) and the filter's own configuration parser, the mesh settings and policies they
//! depend on, every Envoy configuration through `envoy --mode validate` with the built filter
//! and against the hardening every shipped configuration keeps (docs/security.md), the
//! hardening observed in a running Envoy, and the docker-compose stack's references. Needs
//! nothing beside the repository but Envoy (`make envoy`) and the built filter (`make build`).

mod common;
#[path = "common/raw_http.rs"]
mod raw_http;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

use common::{envoy_binary, repo_root, wasm_path};
use pd_filter::config::Config;

/// Envoy's default per-listener buffer limit, which Istio leaves as it is.
const ENVOY_DEFAULT_BUFFER_LIMIT: usize = 1024 * 1024;

fn read(relative: &str) -> String {
    let path = repo_root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every document of a YAML file, as JSON values, with `<<` merge keys applied.
fn yaml_documents(text: &str, name: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|document| {
            let mut value = serde_yaml_ng::Value::deserialize(document)
                .unwrap_or_else(|e| panic!("{name} is not YAML: {e}"));
            value
                .apply_merge()
                .unwrap_or_else(|e| panic!("{name}: merge keys: {e}"));
            serde_json::to_value(value).unwrap_or_else(|e| panic!("{name}: {e}"))
        })
        .filter(|value| !value.is_null())
        .collect()
}

fn yaml_file(relative: &str) -> Vec<Value> {
    yaml_documents(&read(relative), relative)
}

/// Every Kubernetes object under deploy/istio/, with the file it came from.
fn istio_objects() -> Vec<(String, Value)> {
    let dir = repo_root().join("deploy/istio");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("dir entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    let mut objects = Vec::new();
    for file in files {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(&file).expect("manifest");
        for object in yaml_documents(&text, &name) {
            objects.push((name.clone(), object));
        }
    }
    objects
}

fn objects_of_kind(kind: &str) -> Vec<Value> {
    istio_objects()
        .into_iter()
        .map(|(_, object)| object)
        .filter(|object| object["kind"] == kind)
        .collect()
}

fn only_object_of_kind(kind: &str) -> Value {
    let mut objects = objects_of_kind(kind);
    assert_eq!(objects.len(), 1, "expected one {kind} in deploy/istio");
    objects.remove(0)
}

fn wasm_plugin() -> Value {
    let plugins = yaml_file("deploy/istio/wasmplugin.yaml");
    assert_eq!(
        plugins.len(),
        1,
        "deploy/istio/wasmplugin.yaml: one document"
    );
    plugins.into_iter().next().expect("one document")
}

// ---------------------------------------------------------------------------------------------
// (a) The WasmPlugin against the schema of Istio's WasmPlugin resource.

const WASM_PLUGIN_API_VERSION: &str = "extensions.istio.io/v1alpha1";
const WASM_PLUGIN_KIND: &str = "WasmPlugin";

/// What a `targetRef` (and each of `targetRefs`) holds.
fn target_reference_schema() -> Value {
    json!({
        "type": "object",
        "required": ["kind", "name"],
        "additionalProperties": false,
        "properties": {
            // Empty (the core group) or a DNS subdomain.
            "group": {
                "type": "string",
                "maxLength": 253,
                "pattern": "^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
            },
            "kind": {
                "type": "string",
                "minLength": 1,
                "maxLength": 63,
                "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
            },
            "name": { "type": "string", "minLength": 1, "maxLength": 253 },
            "namespace": { "type": "string" }
        }
    })
}

/// `vmConfig`: environment variables for the plugin's VM.
fn vm_config_schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "properties": {
            "env": {
                "type": "array",
                "maxItems": 256,
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": false,
                    "properties": {
                        "name": { "type": "string", "minLength": 1, "maxLength": 256 },
                        "value": { "type": "string", "maxLength": 2048 },
                        "valueFrom": { "type": "string", "enum": ["INLINE", "HOST"] }
                    }
                }
            }
        }
    })
}

/// `match`: which traffic (mode, ports) the plugin applies to.
fn traffic_selector_schema() -> Value {
    json!({
        "type": "array",
        "items": {
            "type": "object",
            "additionalProperties": false,
            "properties": {
                "mode": {
                    "type": "string",
                    "enum": ["UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER"]
                },
                "ports": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": false,
                        "properties": {
                            "number": { "type": "integer", "minimum": 1, "maximum": 65535 }
                        }
                    }
                }
            }
        }
    })
}

/// Istio's `WasmPlugin` (`extensions.istio.io/v1alpha1`) as a JSON schema, written here from the
/// fields, types, enumerations and bounds of Istio's WasmPlugin reference, so that the test
/// needs nothing beside the repository.
///
/// Stricter than the cluster in one way on purpose: Kubernetes silently drops (prunes) a field
/// the resource does not declare, so a misspelt `failStratgy` would be dropped and the plugin
/// would run with the default. Here every object except `pluginConfig` (free-form, handed to
/// the filter) and the label map forbids undeclared fields. Kubernetes checks `metadata`
/// itself; the fields a manifest may carry there are stated here.
fn wasm_plugin_schema() -> Value {
    let string_enum = |values: &[&str]| json!({ "type": "string", "enum": values });
    json!({
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": false,
        "properties": {
            "apiVersion": { "enum": [WASM_PLUGIN_API_VERSION] },
            "kind": { "enum": [WASM_PLUGIN_KIND] },
            "metadata": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": false,
                "properties": {
                    "name": { "type": "string", "minLength": 1 },
                    "namespace": { "type": "string", "minLength": 1 },
                    "labels": { "type": "object" },
                    "annotations": { "type": "object" }
                }
            },
            "spec": {
                "type": "object",
                "required": ["url"],
                "additionalProperties": false,
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": false,
                        "properties": {
                            "matchLabels": {
                                "type": "object",
                                "maxProperties": 4096,
                                "additionalProperties": { "type": "string", "maxLength": 63 }
                            }
                        }
                    },
                    "targetRef": target_reference_schema(),
                    "targetRefs": {
                        "type": "array",
                        "maxItems": 16,
                        "items": target_reference_schema()
                    },
                    "url": { "type": "string", "minLength": 1 },
                    "sha256": { "type": "string", "pattern": "(^$|^[a-f0-9]{64}$)" },
                    "imagePullPolicy": string_enum(&["UNSPECIFIED_POLICY", "IfNotPresent", "Always"]),
                    "imagePullSecret": { "type": "string", "minLength": 1, "maxLength": 253 },
                    "pluginConfig": { "type": "object" },
                    "pluginName": { "type": "string", "minLength": 1, "maxLength": 256 },
                    "phase": string_enum(&["UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"]),
                    "priority": { "type": ["integer", "null"] },
                    "failStrategy": string_enum(&["FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"]),
                    "verificationKey": { "type": "string" },
                    "vmConfig": vm_config_schema(),
                    "match": traffic_selector_schema(),
                    "type": string_enum(&["UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK"])
                }
            }
        }
    })
}

/// What is wrong with `manifest` as a WasmPlugin: the schema's errors, and the rules Istio
/// states beside the schema (which a JSON-schema validator does not express).
fn wasm_plugin_errors(manifest: &Value) -> Vec<String> {
    let schema = wasm_plugin_schema();
    let validator = jsonschema::draft7::new(&schema).expect("the WasmPlugin schema compiles");
    let mut errors: Vec<String> = validator
        .iter_errors(manifest)
        .map(|error| format!("{} at {}", error, error.instance_path()))
        .collect();
    let spec = &manifest["spec"];
    let targets = ["selector", "targetRef", "targetRefs"]
        .iter()
        .filter(|key| spec.get(**key).is_some())
        .count();
    if targets > 1 {
        errors.push("only one of targetRefs or selector can be set".into());
    }
    if let Some(url) = spec["url"].as_str() {
        let scheme_ok = match url.split_once("://") {
            Some((scheme, _)) => ["http", "https", "oci", "file"].contains(&scheme),
            None => true,
        };
        if !scheme_ok {
            errors.push(format!(
                "url {url:?} must have schema one of [http, https, file, oci]"
            ));
        }
    }
    if let Some(labels) = spec["selector"]["matchLabels"].as_object() {
        for (key, value) in labels {
            if key.is_empty() || key.contains('*') {
                errors.push(format!("label key {key:?}: empty or wildcard"));
            }
            if value.as_str().is_some_and(|value| value.contains('*')) {
                errors.push(format!("label value {value}: wildcard not allowed"));
            }
        }
    }
    for env in spec["vmConfig"]["env"].as_array().into_iter().flatten() {
        if env["valueFrom"] == "HOST" && env.get("value").is_some() {
            errors.push(format!(
                "env {}: value may only be set when valueFrom is INLINE",
                env["name"]
            ));
        }
    }
    errors
}

#[test]
fn wasm_plugin_passes_istios_wasm_plugin_schema() {
    let manifest = wasm_plugin();
    let errors = wasm_plugin_errors(&manifest);
    assert!(errors.is_empty(), "WasmPlugin rejected: {errors:#?}");

    assert_eq!(manifest["apiVersion"], WASM_PLUGIN_API_VERSION);
    assert_eq!(manifest["kind"], WASM_PLUGIN_KIND);
    let spec = &manifest["spec"];
    // Deployment choices the README relies on.
    assert!(
        spec["url"]
            .as_str()
            .is_some_and(|url| url.starts_with("oci://")),
        "url: {}",
        spec["url"]
    );
    assert_eq!(
        spec["failStrategy"], "FAIL_RELOAD",
        "fail closed (no request may reach decode without its prefill), and reload a VM that \
         died (under FAIL_CLOSE its worker answers 503 until the gateway restarts)"
    );
    assert_eq!(
        spec["phase"], "STATS",
        "after Istio's authn and authz filters"
    );
    assert_eq!(spec["type"], "HTTP");
    assert!(spec["imagePullPolicy"].is_string());
    assert!(spec["selector"]["matchLabels"].is_object());
}

/// What an edit changes, an excerpt of the error it must cause, and how to make it.
type Edit = (&'static str, &'static str, fn(&mut Value));

/// What is broken, an excerpt of the error it must cause, and how to break a manifest so.
type Breakage = Edit;

/// Asserts `errors_of` finds in `valid`, after each of `edits`, the error that edit must
/// cause; `document` says what was edited, for the message.
fn assert_each_edit_is_caught(
    document: &str,
    valid: &Value,
    edits: &[Edit],
    errors_of: fn(&Value) -> Vec<String>,
) {
    for (what, expected, edit) in edits {
        let mut edited = valid.clone();
        edit(&mut edited);
        let errors = errors_of(&edited);
        assert!(
            errors.iter().any(|error| error.contains(expected)),
            "{document} with {what}: expected an error with {expected:?}, got {errors:?}"
        );
    }
}

#[test]
fn broken_wasm_plugins_are_rejected() {
    let valid = wasm_plugin();
    let breakages: &[Breakage] = &[
        ("no url", "\"url\" is a required property", |m| {
            m["spec"].as_object_mut().unwrap().remove("url");
        }),
        ("empty url", "shorter than", |m| {
            m["spec"]["url"] = json!("")
        }),
        ("unknown failStrategy", "FAIL_SOMETIMES", |m| {
            m["spec"]["failStrategy"] = json!("FAIL_SOMETIMES")
        }),
        ("misspelt failStrategy", "failStratgy", |m| {
            let spec = m["spec"].as_object_mut().unwrap();
            let strategy = spec.remove("failStrategy").unwrap();
            spec.insert("failStratgy".into(), strategy);
        }),
        ("unknown phase", "PREFILL", |m| {
            m["spec"]["phase"] = json!("PREFILL")
        }),
        ("pluginConfig as a string", "not of type \"object\"", |m| {
            m["spec"]["pluginConfig"] = json!("{\"prefill_cluster\":\"p\"}")
        }),
        ("bad sha256", "does not match", |m| {
            m["spec"]["sha256"] = json!("abc")
        }),
        ("bad imagePullPolicy", "Never", |m| {
            m["spec"]["imagePullPolicy"] = json!("Never")
        }),
        ("matchLabels as a list", "not of type \"object\"", |m| {
            m["spec"]["selector"]["matchLabels"] = json!(["app"])
        }),
        ("selector and targetRefs", "only one of", |m| {
            m["spec"]["targetRefs"] = json!([{ "kind": "Gateway", "name": "g" }])
        }),
        ("unknown url scheme", "must have schema", |m| {
            m["spec"]["url"] = json!("ftp://example.com/pd.wasm")
        }),
        ("wrong apiVersion", "v1alpha1", |m| {
            m["apiVersion"] = json!("extensions.istio.io/v1")
        }),
        ("no name", "\"name\" is a required property", |m| {
            m["metadata"].as_object_mut().unwrap().remove("name");
        }),
        ("no spec", "\"spec\" is a required property", |m| {
            m.as_object_mut().unwrap().remove("spec");
        }),
        ("a wildcard label", "wildcard", |m| {
            m["spec"]["selector"]["matchLabels"]["istio"] = json!("vllm-*")
        }),
        ("an unknown vmConfig field", "envs", |m| {
            m["spec"]["vmConfig"] = json!({ "envs": [] })
        }),
        (
            "a HOST env with a value",
            "only be set when valueFrom is INLINE",
            |m| {
                m["spec"]["vmConfig"] =
                    json!({ "env": [{ "name": "A", "valueFrom": "HOST", "value": "x" }] })
            },
        ),
        (
            "a port out of range",
            "65536",
            |m| m["spec"]["match"] = json!([{ "mode": "SERVER", "ports": [{ "number": 65536 }] }]),
        ),
    ];
    assert_each_edit_is_caught("a WasmPlugin", &valid, breakages, wasm_plugin_errors);
}

// ---------------------------------------------------------------------------------------------
// (b) The pluginConfig against the filter's own parser, and the names it shares with the rest.

#[test]
fn plugin_config_parses_with_the_filters_parser() {
    let manifest = wasm_plugin();
    let plugin_config = &manifest["spec"]["pluginConfig"];
    assert!(plugin_config.is_object(), "pluginConfig: {plugin_config}");
    // Istio hands the plugin its pluginConfig as JSON text.
    let bytes = serde_json::to_vec(plugin_config).expect("json");
    let config = Config::from_json(&bytes).unwrap_or_else(|e| panic!("{e}"));

    assert_eq!(
        config.prefill_cluster,
        plugin_config["prefill_cluster"].as_str().expect("set")
    );
    assert!(
        config.max_request_body_bytes < ENVOY_DEFAULT_BUFFER_LIMIT,
        "max_request_body_bytes {} must stay below the gateway's buffer limit, or clients get \
         Envoy's bare 413",
        config.max_request_body_bytes
    );
}

/// `outbound|PORT||NAME.NAMESPACE.svc.cluster.local` → (NAME, NAMESPACE, PORT).
fn parse_istio_cluster(cluster: &str) -> (String, String, u64) {
    let parts: Vec<&str> = cluster.split('|').collect();
    assert_eq!(parts.len(), 4, "{cluster:?} is not outbound|PORT||HOST");
    assert_eq!(parts[0], "outbound", "{cluster:?}");
    assert_eq!(parts[2], "", "{cluster:?}: no subset expected");
    let port = parts[1]
        .parse()
        .unwrap_or_else(|_| panic!("port in {cluster:?}"));
    let (name, namespace) = parse_service_host(parts[3]);
    (name, namespace, port)
}

fn parse_service_host(host: &str) -> (String, String) {
    let rest = host
        .strip_suffix(".svc.cluster.local")
        .unwrap_or_else(|| panic!("{host:?} is not a Service FQDN"));
    let (name, namespace) = rest
        .split_once('.')
        .unwrap_or_else(|| panic!("{host:?} has no namespace"));
    (name.to_owned(), namespace.to_owned())
}

fn service(name: &str, namespace: &str) -> Value {
    objects_of_kind("Service")
        .into_iter()
        .find(|s| s["metadata"]["name"] == name && s["metadata"]["namespace"] == namespace)
        .unwrap_or_else(|| panic!("no Service {namespace}/{name} in deploy/istio"))
}

fn service_has_port(service: &Value, port: u64) -> bool {
    service["spec"]["ports"]
        .as_array()
        .is_some_and(|ports| ports.iter().any(|p| p["port"] == port))
}

#[test]
fn istio_names_agree_across_the_manifests() {
    let plugin = wasm_plugin();
    let plugin_namespace = &plugin["metadata"]["namespace"];

    // The prefill cluster is the example prefill Service, in Istio's naming.
    let cluster = plugin["spec"]["pluginConfig"]["prefill_cluster"]
        .as_str()
        .expect("prefill_cluster");
    let (name, namespace, port) = parse_istio_cluster(cluster);
    let prefill_host = format!("{name}.{namespace}.svc.cluster.local");
    assert!(
        service_has_port(&service(&name, &namespace), port),
        "Service {namespace}/{name} has no port {port}"
    );

    // The Gateway runs on the pods the plugin selects, in the plugin's namespace.
    let gateway = only_object_of_kind("Gateway");
    assert_eq!(
        gateway["spec"]["selector"], plugin["spec"]["selector"]["matchLabels"],
        "the WasmPlugin must select the Gateway's pods"
    );
    assert_eq!(&gateway["metadata"]["namespace"], plugin_namespace);

    // The route goes to the decode Service, bound to that Gateway, with no overall timeout.
    let virtual_service = only_object_of_kind("VirtualService");
    let gateway_name = gateway["metadata"]["name"].as_str().expect("name");
    assert!(
        virtual_service["spec"]["gateways"]
            .as_array()
            .is_some_and(|gateways| gateways.iter().any(|g| g == gateway_name)),
        "the VirtualService must be bound to the Gateway {gateway_name}"
    );
    let all_routes = virtual_service["spec"]["http"].as_array().expect("http");
    // vLLM's operator endpoints: those under /v1/ answered 404 first, no route to the others.
    let first = &all_routes[0];
    assert!(
        first["directResponse"]["status"] == 404
            && first["match"][0]["uri"]["regex"]
                .as_str()
                .is_some_and(|regex| {
                    [
                        "load_lora_adapter",
                        "pd_kv_ready",
                        "fault_tolerance",
                        "requests/",
                        "admin/",
                    ]
                    .iter()
                    .all(|endpoint| regex.contains(endpoint))
                }),
        "the VirtualService must answer vLLM's operator endpoints under /v1/ 404 first: {first}"
    );
    let routes: Vec<Value> = all_routes
        .iter()
        .filter(|route| route["directResponse"].is_null())
        .cloned()
        .collect();
    assert!(!routes.is_empty());
    for operator in [
        "/inference/v1/abort_requests",
        "/abort_requests",
        "/scale_elastic_ep",
        "/sleep",
        "/collective_rpc",
        "/update_weights",
        "/drop_peer",
        "/metrics",
        "/load",
    ] {
        let routed = routes.iter().any(|route| {
            route["match"].as_array().into_iter().flatten().any(|m| {
                m["uri"]["exact"] == operator
                    || m["uri"]["prefix"]
                        .as_str()
                        .is_some_and(|prefix| operator.starts_with(prefix))
            })
        });
        assert!(!routed, "the VirtualService routes vLLM's {operator}");
    }
    for route in &routes {
        assert_eq!(route["timeout"], "0s", "long generations: {route}");
        // Under the WasmPlugin the request headers go on before prefill: a retry would send
        // decode the client's body as Envoy holds it while prefill runs. Istio retries
        // connection failures unless told otherwise.
        assert_eq!(
            route["retries"]["attempts"], 0,
            "decode routes must not retry under the WasmPlugin: {route}"
        );
        for destination in route["route"].as_array().expect("route") {
            let host = destination["destination"]["host"].as_str().expect("host");
            let (name, namespace) = parse_service_host(host);
            let port = destination["destination"]["port"]["number"]
                .as_u64()
                .expect("port");
            assert!(service_has_port(&service(&name, &namespace), port));
            assert_ne!(host, prefill_host, "clients must be routed to decode");
        }
    }

    // Every path the plugin orchestrates reaches decode through the gateway, and the plugin
    // releases KV through the Service that route goes to.
    let plugin_config = serde_json::to_vec(&plugin["spec"]["pluginConfig"]).expect("json");
    let config = Config::from_json(&plugin_config).unwrap_or_else(|e| panic!("{e}"));
    for orchestrated in &config.orchestrated_paths {
        let path = orchestrated.path.as_str();
        assert!(
            routes.iter().any(|route| {
                route["match"].as_array().into_iter().flatten().any(|m| {
                    m["uri"]["exact"] == path
                        || m["uri"]["prefix"]
                            .as_str()
                            .is_some_and(|prefix| path.starts_with(prefix))
                })
            }),
            "the VirtualService does not route {path}, which the plugin orchestrates"
        );
    }
    // KV releases go to the pods the gateway routes to, through a Service of their own.
    let (release_name, release_namespace, release_port) =
        parse_istio_cluster(&config.decode_cluster);
    let release_service = service(&release_name, &release_namespace);
    assert!(service_has_port(&release_service, release_port));
    for route in &routes {
        for destination in route["route"].as_array().expect("route") {
            let (name, namespace) =
                parse_service_host(destination["destination"]["host"].as_str().expect("host"));
            assert_ne!(
                name, release_name,
                "KV releases must not share the pool the gateway routes clients to"
            );
            let routed = service(&name, &namespace);
            assert_eq!(
                (
                    &release_service["spec"]["selector"],
                    destination["destination"]["port"]["number"].as_u64()
                ),
                (&routed["spec"]["selector"], Some(release_port)),
                "KV releases must go to the decode pods the gateway routes to"
            );
        }
    }

    // Each DestinationRule names an example Service.
    let rules = objects_of_kind("DestinationRule");
    assert!(!rules.is_empty());
    for rule in rules {
        let (name, namespace) = parse_service_host(rule["spec"]["host"].as_str().expect("host"));
        service(&name, &namespace);
    }
}

// ---------------------------------------------------------------------------------------------
// (d) The Kubernetes manifests and the compose stack.

#[test]
fn istio_ejects_workers_on_gateway_errors_only() {
    // Istio counts any 5xx unless consecutive5xxErrors is 0: a client whose requests make
    // vLLM answer 500 could eject workers for everyone.
    for rule in objects_of_kind("DestinationRule") {
        let outlier = &rule["spec"]["trafficPolicy"]["outlierDetection"];
        if outlier.is_object() {
            assert_eq!(outlier["consecutive5xxErrors"], 0, "{rule}");
            assert!(outlier["consecutiveGatewayErrors"]
                .as_u64()
                .is_some_and(|n| n > 0));
        }
    }
}

#[test]
fn kubernetes_manifests_are_well_formed() {
    let objects = istio_objects();
    for (file, object) in &objects {
        for key in ["apiVersion", "kind"] {
            assert!(
                object[key].as_str().is_some_and(|s| !s.is_empty()),
                "{file}: an object without {key}: {object}"
            );
        }
        let kind = object["kind"].as_str().unwrap_or_default();
        assert!(
            object["metadata"]["name"]
                .as_str()
                .is_some_and(|s| !s.is_empty()),
            "{file}: a {kind} without metadata.name"
        );
        if kind != "Namespace" {
            assert!(
                object["metadata"]["namespace"].is_string(),
                "{file}: {kind} {} has no namespace",
                object["metadata"]["name"]
            );
        }
    }
    for kind in [
        "WasmPlugin",
        "Service",
        "Deployment",
        "Gateway",
        "VirtualService",
        "DestinationRule",
    ] {
        assert!(
            objects.iter().any(|(_, object)| object["kind"] == kind),
            "deploy/istio has no {kind}"
        );
    }

    // Each Service selects the pods of a Deployment; each Deployment's selector matches its
    // own pod template; each vLLM worker runs the NIXL connector in the kv_both role.
    let deployments = objects_of_kind("Deployment");
    for deployment in &deployments {
        let name = &deployment["metadata"]["name"];
        let selector = deployment["spec"]["selector"]["matchLabels"]
            .as_object()
            .expect("matchLabels");
        let labels = &deployment["spec"]["template"]["metadata"]["labels"];
        for (key, value) in selector {
            assert_eq!(&labels[key], value, "Deployment {name}: selector {key}");
        }
        for container in deployment["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers")
        {
            let line: Vec<&str> = container["command"]
                .as_array()
                .into_iter()
                .chain(container["args"].as_array())
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            assert_eq!(line.get(..2), Some(&["vllm", "serve"][..]), "{name}");
            let at = line
                .iter()
                .position(|arg| *arg == "--kv-transfer-config")
                .unwrap_or_else(|| panic!("Deployment {name}: no --kv-transfer-config"));
            let kv_config: Value = serde_json::from_str(line.get(at + 1).expect("a value"))
                .expect("--kv-transfer-config takes JSON");
            assert_eq!(
                kv_config,
                json!({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
            );
        }
    }
    for service in objects_of_kind("Service") {
        let selector = service["spec"]["selector"].as_object().expect("selector");
        assert!(
            deployments.iter().any(|deployment| {
                let labels = &deployment["spec"]["template"]["metadata"]["labels"];
                selector.iter().all(|(key, value)| &labels[key] == value)
            }),
            "Service {} selects no Deployment",
            service["metadata"]["name"]
        );
    }
}

/// Whether a Kubernetes label selector (`matchLabels`, `matchExpressions` with `In`) selects
/// pods with `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let labels_match = selector["matchLabels"]
        .as_object()
        .into_iter()
        .flatten()
        .all(|(key, value)| &labels[key] == value);
    let expressions_match = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|expression| {
            assert_eq!(expression["operator"], "In", "{expression}");
            let key = expression["key"].as_str().expect("key");
            expression["values"]
                .as_array()
                .is_some_and(|values| values.contains(&labels[key]))
        });
    labels_match && expressions_match
}

/// The NetworkPolicy keeps the vLLM workers to the gateway (on their API port) and to each
/// other (the KV transfer, outside the mesh): no client reaches a worker past the filter.
#[test]
fn network_policy_lets_only_the_gateway_reach_the_workers_api() {
    let policy = only_object_of_kind("NetworkPolicy");
    let deployments = objects_of_kind("Deployment");
    assert_eq!(
        policy["metadata"]["namespace"], deployments[0]["metadata"]["namespace"],
        "the policy's namespace is the workers'"
    );
    let gateway_labels = Value::Object(
        only_object_of_kind("WasmPlugin")["spec"]["selector"]["matchLabels"]
            .as_object()
            .expect("the plugin's gateway labels")
            .clone(),
    );
    let spec = &policy["spec"];
    assert!(
        spec["policyTypes"]
            .as_array()
            .is_some_and(|types| types.contains(&Value::from("Ingress"))),
        "the policy restricts ingress"
    );
    let rules = spec["ingress"].as_array().expect("ingress rules");
    for deployment in &deployments {
        let name = &deployment["metadata"]["name"];
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        assert!(
            selects(&spec["podSelector"], pod_labels),
            "the policy covers Deployment {name}"
        );
        let api_ports: Vec<&Value> = deployment["spec"]["template"]["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|container| container["ports"].as_array().into_iter().flatten())
            .filter(|port| port["name"] == "http")
            .map(|port| &port["containerPort"])
            .collect();
        let from_gateway = rules
            .iter()
            .find(|rule| {
                rule["from"].as_array().into_iter().flatten().any(|peer| {
                    selects(&peer["podSelector"], &gateway_labels)
                        && !selects(&peer["podSelector"], pod_labels)
                })
            })
            .expect("a rule for the gateway");
        let gateway_ports: Vec<&Value> = from_gateway["ports"]
            .as_array()
            .expect("the gateway's rule names its ports")
            .iter()
            .map(|port| &port["port"])
            .collect();
        assert_eq!(
            gateway_ports, api_ports,
            "the gateway reaches {name}'s API only"
        );
    }
    for rule in rules {
        let peers = rule["from"].as_array().expect("every rule names its peers");
        assert!(!peers.is_empty(), "a rule open to every source: {rule}");
        for peer in peers {
            // An empty or missing pod selector picks every pod (of the namespaces selected).
            let narrowed = ["matchLabels", "matchExpressions"].iter().any(|key| {
                peer["podSelector"][key]
                    .as_object()
                    .map(|labels| !labels.is_empty())
                    .or_else(|| peer["podSelector"][key].as_array().map(|e| !e.is_empty()))
                    .unwrap_or(false)
            });
            assert!(narrowed, "a peer that selects every pod: {peer}");
            let selected_someone = deployments.iter().any(|deployment| {
                selects(
                    &peer["podSelector"],
                    &deployment["spec"]["template"]["metadata"]["labels"],
                )
            }) || selects(&peer["podSelector"], &gateway_labels);
            assert!(
                selected_someone && peer["ipBlock"].is_null(),
                "a peer other than the gateway and the workers: {peer}"
            );
        }
    }
}

/// `ADDR:PORT` → PORT.
/// The workers' sidecars enforce the NetworkPolicy's rule for the API port themselves:
/// only the gateway's identity reaches it, even where the CNI ignores NetworkPolicy.
#[test]
fn worker_sidecars_admit_only_the_gateway_to_the_api() {
    let gateway_account = "/sa/vllm-gateway";
    let policies: Vec<Value> = objects_of_kind("AuthorizationPolicy")
        .into_iter()
        .filter(|policy| policy["spec"]["action"] == "ALLOW")
        .collect();
    for deployment in objects_of_kind("Deployment") {
        let name = &deployment["metadata"]["name"];
        let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        let policy = policies
            .iter()
            .find(|policy| {
                policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
                    && selects(&policy["spec"]["selector"], pod_labels)
            })
            .unwrap_or_else(|| panic!("no ALLOW AuthorizationPolicy selects {name}"));
        for rule in policy["spec"]["rules"].as_array().expect("rules") {
            let operations: Vec<&Value> = rule["to"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|to| &to["operation"])
                .collect();
            let reaches_api = operations.is_empty()
                || operations.iter().any(|operation| {
                    let listed = |key: &str| {
                        operation[key]
                            .as_array()
                            .is_some_and(|ports| ports.contains(&Value::from("8000")))
                    };
                    if operation["ports"].is_array() {
                        listed("ports")
                    } else {
                        !listed("notPorts")
                    }
                });
            if !reaches_api {
                continue;
            }
            let sources: Vec<&Value> = rule["from"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|from| &from["source"])
                .collect();
            assert!(
                !sources.is_empty(),
                "{name}: the API open to anyone: {rule}"
            );
            for source in sources {
                let principals = source["principals"].as_array().expect("principals only");
                assert!(
                    principals.iter().all(|principal| principal
                        .as_str()
                        .is_some_and(|p| p.ends_with(gateway_account))),
                    "{name}: the API open to more than the gateway: {rule}"
                );
                let keys = source.as_object().map(|o| o.len()).unwrap_or(0);
                assert_eq!(keys, 1, "{name}: a source beside the principals: {source}");
            }
        }
    }
}

fn port_of(address: &str) -> u64 {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address:?}"))
}

#[test]
fn compose_stack_references_what_exists() {
    let root = repo_root();
    let compose = yaml_file("docker-compose.yml");
    assert_eq!(compose.len(), 1);
    let services = compose[0]["services"].as_object().expect("services");
    for name in ["prefill", "decode", "envoy"] {
        assert!(services.contains_key(name), "docker-compose.yml: no {name}");
    }

    for (name, service) in services {
        if let Some(build) = service.get("build") {
            let context = root.join(build["context"].as_str().expect("build.context"));
            assert!(context.is_dir(), "{name}: {}", context.display());
            let dockerfile = context.join(build["dockerfile"].as_str().unwrap_or("Dockerfile"));
            assert!(dockerfile.is_file(), "{name}: {}", dockerfile.display());
        }
        assert!(
            service["image"].is_string(),
            "{name}: every service names its image"
        );
    }

    // The mock servers listen where envoy-compose.yaml's clusters point.
    let envoy_config = yaml_file("envoy/envoy-compose.yaml").remove(0);
    for role in ["prefill", "decode"] {
        let command: Vec<&str> = services[role]["command"]
            .as_array()
            .expect("command")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let flag = format!("--{role}");
        let at = command
            .iter()
            .position(|arg| *arg == flag)
            .unwrap_or_else(|| panic!("{role}: no {flag}"));
        let port = port_of(command[at + 1]);
        let cluster = envoy_config["static_resources"]["clusters"]
            .as_array()
            .expect("clusters")
            .iter()
            .find(|cluster| cluster["name"] == role)
            .unwrap_or_else(|| panic!("envoy-compose.yaml: no cluster {role}"));
        let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            ["address"]["socket_address"];
        assert_eq!(address["address"], role.to_string(), "cluster {role}");
        assert_eq!(address["port_value"], port, "cluster {role}");
    }

    // Envoy: the official image, its configuration and the filter mounted where it reads them.
    let envoy = &services["envoy"];
    assert!(envoy["image"]
        .as_str()
        .is_some_and(|image| image.starts_with("envoyproxy/envoy:v1.40")));
    let command: Vec<&str> = envoy["command"]
        .as_array()
        .expect("envoy command")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_in_container = command
        .iter()
        .position(|arg| *arg == "-c")
        .and_then(|at| command.get(at + 1))
        .expect("envoy -c");
    let mut mounts = Vec::new();
    for volume in envoy["volumes"].as_array().expect("volumes") {
        let volume = volume.as_str().expect("short volume syntax");
        let mut parts = volume.split(':');
        let host = parts.next().expect("host path");
        let container = parts.next().expect("container path");
        mounts.push((host.to_owned(), container.to_owned()));
        if host == "./target/wasm32-wasip1/release/pd_filter.wasm" {
            continue; // what `make build` produces, checked below
        }
        assert!(root.join(host).exists(), "envoy mounts a missing {host}");
    }
    let mounted = |container: &str| {
        mounts
            .iter()
            .find(|(_, c)| c == container)
            .map(|(h, _)| h.as_str())
    };
    assert_eq!(
        mounted(config_in_container),
        Some("./envoy/envoy-compose.yaml")
    );
    let wasm_filename = read("envoy/envoy-compose.yaml")
        .lines()
        .find_map(|line| line.trim().strip_prefix("filename: ").map(str::to_owned))
        .expect("envoy-compose.yaml: wasm filename");
    assert_eq!(
        mounted(&wasm_filename),
        Some("./target/wasm32-wasip1/release/pd_filter.wasm"),
        "the filter must be mounted at {wasm_filename}"
    );
}

#[test]
fn oci_image_has_istios_wasm_layout() {
    let dockerfile = read("deploy/oci/Dockerfile");
    let instructions: Vec<&str> = dockerfile
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .collect();
    assert_eq!(
        instructions,
        ["FROM scratch", "COPY plugin.wasm ./plugin.wasm"],
        "Istio pulls an image whose only file is /plugin.wasm"
    );
    let makefile = read("Makefile");
    assert!(
        makefile.contains("target/oci/plugin.wasm") && makefile.contains("deploy/oci/Dockerfile")
    );
}

// ---------------------------------------------------------------------------------------------
// (c) Every Envoy configuration through `envoy --mode validate`.

/// Placeholder paths in the example configurations and what the test puts there.
const WASM_PLACEHOLDERS: &[&str] = &[
    "filename: target/wasm32-wasip1/release/pd_filter.wasm",
    "filename: /etc/envoy/pd_filter.wasm",
];
const CERT_DIR_PLACEHOLDER: &str = "/etc/envoy/certs/";

fn scratch_dir(label: &str) -> PathBuf {
    let dir = repo_root()
        .join("target/manifests-test")
        .join(format!("{}-{label}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A CA and a client certificate it signed, in PEM files named as the TLS example names them.
fn write_test_certs(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let client_key = KeyPair::generate().expect("client key");
    let client = CertificateParams::new(vec!["pd-filter.example.com".to_owned()])
        .expect("client params")
        .signed_by(&client_key, &Issuer::from_params(&ca_params, &ca_key))
        .expect("client certificate");
    for (name, pem) in [
        ("ca.pem", ca.pem()),
        ("client.pem", client.pem()),
        ("client-key.pem", client_key.serialize_pem()),
    ] {
        std::fs::write(dir.join(name), pem).expect("write PEM");
    }
}

/// The configuration with its placeholder paths pointing at the built filter and test certs.
fn localize(config: &str, wasm: &Path, certs: &Path) -> String {
    let mut config = config.to_owned();
    for placeholder in WASM_PLACEHOLDERS {
        config = config.replace(placeholder, &format!("filename: {}", wasm.display()));
    }
    config.replace(CERT_DIR_PLACEHOLDER, &format!("{}/", certs.display()))
}

/// Runs `envoy --mode validate`; Err holds Envoy's output.
fn envoy_validate(config_path: &Path) -> Result<(), String> {
    let output = Command::new(envoy_binary())
        .arg("--mode")
        .arg("validate")
        .arg("-c")
        .arg(config_path)
        .args(["-l", "warn"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run envoy ({e}); run `make envoy` or set ENVOY_BIN"));
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

fn envoy_configs() -> Vec<PathBuf> {
    let mut configs = Vec::new();
    for dir in ["envoy", "envoy/examples"] {
        let dir = repo_root().join(dir);
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if path.extension().is_some_and(|ext| ext == "yaml") {
                configs.push(path);
            }
        }
    }
    configs.sort();
    configs
}

#[test]
fn every_envoy_config_passes_envoy_validate() {
    let wasm = wasm_path();
    let dir = scratch_dir("validate");
    write_test_certs(&dir);

    let configs = envoy_configs();
    for expected in [
        "envoy/envoy.yaml",
        "envoy/envoy-compose.yaml",
        "envoy/examples/multi-endpoint.yaml",
        "envoy/examples/per-model.yaml",
        "envoy/examples/scheduler.yaml",
        "envoy/examples/tls-upstream.yaml",
    ] {
        assert!(
            configs.contains(&repo_root().join(expected)),
            "{expected} is missing"
        );
    }
    let mut failures = Vec::new();
    for config in &configs {
        let relative = config.strip_prefix(repo_root()).unwrap_or(config);
        let text = std::fs::read_to_string(config).expect("config");
        let localized = localize(&text, &wasm, &dir);
        // Every file path in the configuration is one the test knows how to stand in for.
        assert!(
            !localized
                .lines()
                .any(|line| !line.trim_start().starts_with('#') && line.contains("/etc/envoy/")),
            "{}: a path the test does not replace",
            relative.display()
        );
        if text.contains("envoy.filters.http.wasm") {
            assert!(
                localized.contains(&format!("filename: {}", wasm.display())),
                "{}: the wasm filename is not a known placeholder",
                relative.display()
            );
        }
        let target = dir.join(relative.to_string_lossy().replace('/', "__"));
        std::fs::write(&target, localized).expect("write config");
        if let Err(output) = envoy_validate(&target) {
            failures.push(format!("{}:\n{output}", relative.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Validation really loads the filter: a configuration the filter rejects fails it, with the
/// line the README's troubleshooting names, saying which key is wrong.
#[test]
fn envoy_validate_runs_the_filters_configuration() {
    let wasm = wasm_path();
    let dir = scratch_dir("validate-bad");
    let text = read("envoy/envoy.yaml");
    let shipped = "\"decode_cluster\": \"decode-release\"";
    assert!(text.contains(shipped), "envoy.yaml sets decode_cluster");
    let cases = [
        (
            text.replace("\"prefill_timeout_ms\"", "\"prefill_timeout\""),
            "unknown key \"prefill_timeout\"",
        ),
        (
            text.replace(
                shipped,
                "\"decode_cluster\": \"decode-release\", \"truncate_to_context\": \"auto\"",
            ),
            "truncate_to_context must be one of refuse, serve",
        ),
        (
            text.replace(
                shipped,
                "\"decode_cluster\": \"decode-release\", \"client_ec_transfer_params\": true",
            ),
            "client_ec_transfer_params must be one of refuse, pass",
        ),
        (
            text.replace(
                shipped,
                "\"decode_cluster\": \"decode-release\", \"prefill_cluster\": \"other\"",
            ),
            "\"prefill_cluster\" is given twice",
        ),
    ];
    for (index, (broken, said)) in cases.iter().enumerate() {
        assert_ne!(broken, &text, "{said}: the edit applies to envoy.yaml");
        let target = dir.join(format!("envoy-bad-plugin-config-{index}.yaml"));
        std::fs::write(&target, localize(broken, &wasm, &dir)).expect("write config");
        let output = envoy_validate(&target).expect_err("a refused plugin configuration fails");
        assert!(
            output.contains(&format!("invalid pd-filter configuration: {said}")),
            "{said}: {output}"
        );
        assert!(
            output.contains("Unable to create Wasm plugin pd-filter"),
            "{output}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (e) The hardening every shipped Envoy configuration keeps (docs/security.md).

/// Request headers that choose a worker. They are trusted only from the operator's own
/// components (a scheduler, the filter itself), so every configuration removes clients' copies
/// before any filter runs.
const TRUSTED_HEADERS: [&str; 6] = [
    "x-prefiller-host-port",
    "x-gateway-destination-endpoint",
    "x-pd-model",
    // Any other header in the filter's x-pd- names, today's and tomorrow's.
    "x-pd-anything",
    // vLLM 0.33 serves a request on the data-parallel engine it names.
    "x-data-parallel-rank",
    // The host an ORIGINAL_DST cluster that reads it connects to.
    "x-envoy-original-dst-host",
];

/// Envoy's routing headers its router obeys from a client it counts as internal
/// (`internal_address_config`; under Istio, `meshNetworks`): a retry on 200 sends decode the
/// same KV again, a timeout cuts generations. Every configuration removes clients' copies.
const ENVOY_ROUTING_HEADERS: [&str; 13] = [
    // A stats name per request: counters Envoy never frees (about 6 KB a request).
    "x-envoy-upstream-alt-stat-name",
    // Cuts the stream after both legs have done their work.
    "x-envoy-upstream-stream-duration-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-force-trace",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-max-retries",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
];

/// The filter's defaults for the keys the checks below read.
const DEFAULT_PREFILL_TIMEOUT_MS: u64 = 120_000;
const DEFAULT_MAX_REQUEST_BODY_BYTES: u64 = 1024 * 1024;

/// An Envoy duration as JSON ("10s", "0.25s") in seconds.
fn seconds(duration: &Value) -> Option<f64> {
    duration.as_str()?.strip_suffix('s')?.parse().ok()
}

/// Each listener with the typed configuration of each of its HTTP connection managers.
fn http_connection_managers(config: &Value) -> Vec<(&Value, &Value)> {
    let mut found = Vec::new();
    for listener in config["static_resources"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for chain in listener["filter_chains"].as_array().into_iter().flatten() {
            for filter in chain["filters"].as_array().into_iter().flatten() {
                if filter["name"] == "envoy.filters.network.http_connection_manager" {
                    found.push((listener, &filter["typed_config"]));
                }
            }
        }
    }
    found
}

/// The wasm filters of a connection manager, each with its plugin configuration as JSON.
fn wasm_filters(hcm: &Value) -> Vec<(&Value, Value)> {
    hcm["http_filters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|filter| filter["name"] == "envoy.filters.http.wasm")
        .map(|filter| {
            let config = &filter["typed_config"]["config"];
            let text = config["configuration"]["value"].as_str().unwrap_or("{}");
            let text = if text.trim().is_empty() { "{}" } else { text };
            let plugin = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("plugin configuration is not JSON ({e}): {text}"));
            (config, plugin)
        })
        .collect()
}

/// The RBAC filter that refuses every request the wasm filter did not mark as seen
/// (envoy/envoy.yaml, pd-filter-guard), as the shipped configurations write it.
fn pd_filter_guard() -> Value {
    json!({
        "name": "pd-filter-guard",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
            "rules_stat_prefix": "pd_filter_guard",
            "rules": {
                "action": "DENY",
                "policies": {
                    "pd-filter-did-not-run": {
                        "permissions": [{"any": true}],
                        "principals": [{"not_id": {"filter_state": {
                            "key": "wasm.pd_filter_ran",
                            "string_match": {"exact": "yes"}
                        }}}]
                    }
                }
            }
        }
    })
}

/// What is wrong with where a connection manager refuses requests Envoy ran without the
/// wasm filter: the guard must come after every wasm filter and before the router.
fn guard_problem(hcm: &Value) -> Option<String> {
    let filters = hcm["http_filters"].as_array().cloned().unwrap_or_default();
    let position = |wanted: &dyn Fn(&Value) -> bool| filters.iter().rposition(wanted);
    let guard = pd_filter_guard();
    let Some(guard_at) = position(&|f| *f == guard) else {
        return Some("no pd-filter-guard (as envoy/envoy.yaml's) among the HTTP filters".into());
    };
    let wasm_at = position(&|f| f["name"] == "envoy.filters.http.wasm");
    let router_at = position(&|f| f["name"] == "envoy.filters.http.router");
    if wasm_at.is_none_or(|wasm| wasm > guard_at) || router_at.is_none_or(|r| r < guard_at) {
        return Some("pd-filter-guard is not between the wasm filter and the router".into());
    }
    let mappers = hcm["local_reply_config"]["mappers"].as_array();
    let answers_503 = mappers.into_iter().flatten().any(|mapper| {
        mapper["status_code"] == 503
            && mapper["filter"]["extension_filter"]["typed_config"]["expression"]
                .as_str()
                .is_some_and(|e| {
                    e.contains("rbac_access_denied_matched_policy[pd-filter-did-not-run]")
                })
    });
    (!answers_503).then(|| "pd-filter-guard's refusals are not answered 503".into())
}

/// vLLM's operator endpoints (aborting requests by id, resizing the deployment, and those its
/// LoRA, profiler, development and RL settings add), as the first routes of envoy/envoy.yaml
/// answer them: 404 from Envoy itself.
fn operator_endpoint_routes() -> Vec<Value> {
    let routes = yaml_file("envoy/envoy.yaml").remove(0)["static_resources"]["listeners"][0]
        ["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
        ["routes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    routes
        .into_iter()
        .take_while(|route| route["direct_response"]["status"] == 404)
        .collect()
}

/// What lets a client reach vLLM's operator endpoints through a connection manager: every
/// virtual host must answer them first, as envoy/envoy.yaml does.
fn operator_endpoints_problem(hcm: &Value) -> Option<String> {
    let denied = operator_endpoint_routes();
    let regexes: String = denied
        .iter()
        .filter_map(|route| route["match"]["safe_regex"]["regex"].as_str())
        .collect();
    if ![
        "abort_requests",
        "scal(e|ing)_elastic_ep",
        "collective_rpc",
        "update_weight",
        "pd_kv_ready|drop_peer",
        "(v1/)?fault_tolerance",
        "kv_event_sources|checkpoint",
        "v1/requests/",
        "v1/(admin/",
        "dashboard",
        "metrics",
    ]
    .iter()
    .all(|endpoint| regexes.contains(endpoint))
    {
        return Some(
            "envoy/envoy.yaml's first routes do not refuse vLLM's operator endpoints".into(),
        );
    }
    let hosts = hcm["route_config"]["virtual_hosts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let open = hosts.iter().find(|host| {
        let routes = host["routes"].as_array().cloned().unwrap_or_default();
        !routes.starts_with(&denied)
    })?;
    Some(format!(
        "virtual host {} does not answer vLLM's operator endpoints 404 first",
        open["name"]
    ))
}

/// Whether a `prefill_hosts_allowed` entry (a CIDR or `ip:port`) lets the callout reach
/// `address`.
fn allows(entry: &str, address: std::net::IpAddr) -> bool {
    use std::net::{IpAddr, SocketAddr};
    if let Some((network, bits)) = entry.split_once('/') {
        let (Ok(network), Ok(bits)) = (network.parse::<IpAddr>(), bits.parse::<u32>()) else {
            return true; // unreadable: assume the worst
        };
        return match (network, address) {
            (IpAddr::V4(network), IpAddr::V4(address)) => {
                let mask = u32::MAX.checked_shl(32 - bits.min(32)).unwrap_or(0);
                u32::from(network) & mask == u32::from(address) & mask
            }
            (IpAddr::V6(network), IpAddr::V6(address)) => {
                let mask = u128::MAX.checked_shl(128 - bits.min(128)).unwrap_or(0);
                u128::from(network) & mask == u128::from(address) & mask
            }
            _ => false,
        };
    }
    match entry.parse::<SocketAddr>() {
        Ok(socket) => socket.ip() == address,
        Err(_) => true,
    }
}

/// What a configuration lacks of the hardening docs/security.md describes. Empty when it keeps
/// all of it.
fn hardening_errors(config: &Value) -> Vec<String> {
    let mut errors = Vec::new();

    // Connections and memory: a connection limit (which the admin endpoint ignores, so that
    // the operator can still look in), and new requests refused near a heap limit.
    let monitors = config["overload_manager"]["resource_monitors"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let monitor = |name: &str| monitors.iter().find(|m| m["name"] == name).cloned();
    match monitor("envoy.resource_monitors.global_downstream_max_connections") {
        Some(m)
            if m["typed_config"]["max_active_downstream_connections"]
                .as_u64()
                .is_some_and(|limit| limit > 0) => {}
        _ => errors.push("no global_downstream_max_connections limit".to_owned()),
    }
    if config["admin"]["ignore_global_conn_limit"] != true {
        errors.push("admin does not ignore the connection limit".to_owned());
    }
    let heap_limited = monitor("envoy.resource_monitors.fixed_heap").is_some_and(|m| {
        m["typed_config"]["max_heap_size_bytes"]
            .as_u64()
            .is_some_and(|bytes| bytes > 0)
    });
    let heap_action = config["overload_manager"]["actions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|action| {
            action["name"] == "envoy.overload_actions.stop_accepting_requests"
                && action["triggers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|trigger| {
                        trigger["name"] == "envoy.resource_monitors.fixed_heap"
                            && trigger["threshold"]["value"]
                                .as_f64()
                                .is_some_and(|value| value > 0.0 && value < 1.0)
                    })
        });
    if !(heap_limited && heap_action) {
        errors.push("no fixed_heap monitor that stops accepting requests".to_owned());
    }
    // Streams already open keep buffering past that: near the limit, the largest are reset
    // (which needs per-stream memory accounting).
    let resets_streams = config["overload_manager"]["actions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|action| {
            action["name"] == "envoy.overload_actions.reset_high_memory_stream"
                && action["triggers"][0]["name"] == "envoy.resource_monitors.fixed_heap"
        });
    let accounted = config["overload_manager"]["buffer_factory_config"]
        ["minimum_account_to_track_power_of_two"]
        .as_u64()
        .is_some_and(|power| (10..=24).contains(&power));
    // Checked often enough for a fast client: at 0.25 s one took Envoy to 2.7 GB under a
    // 300 MB limit.
    let checked_often = seconds(&config["overload_manager"]["refresh_interval"])
        .is_some_and(|interval| interval <= 0.1);
    if !(resets_streams && accounted && checked_often) {
        errors.push(
            "no reset_high_memory_stream on the heap monitor (with buffer accounting, checked \
             every 0.1 s at most): open uploads could grow the heap past its limit"
                .to_owned(),
        );
    }

    // Idle client connections give way near the connection limit, and silent ones are closed:
    // otherwise one client's idle sockets hold every connection for Envoy's hour.
    let idle_shrinks = config["overload_manager"]["actions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|action| {
            action["name"] == "envoy.overload_actions.reduce_timeouts"
                && action["triggers"][0]["name"]
                    == "envoy.resource_monitors.global_downstream_max_connections"
                && action["typed_config"]["timer_scale_factors"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|factor| factor["timer"] == "HTTP_DOWNSTREAM_CONNECTION_IDLE")
        });
    if !idle_shrinks {
        errors.push(
            "no reduce_timeouts of HTTP_DOWNSTREAM_CONNECTION_IDLE on the connection monitor: \
             idle connections hold the connection limit for an hour"
                .to_owned(),
        );
    }
    for listener in config["static_resources"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let inspects = listener["listener_filters"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|filter| filter["name"] == "envoy.filters.listener.http_inspector");
        let bounded = seconds(&listener["listener_filters_timeout"])
            .is_some_and(|timeout| timeout > 0.0 && timeout <= 15.0)
            && listener["continue_on_listener_filters_timeout"] != true;
        if !(inspects && bounded) {
            errors.push(format!(
                "listener {}: a connection that never sends a byte stays open (no \
                 http_inspector with a listener_filters_timeout)",
                listener["name"]
            ));
        }
    }

    let clusters: Vec<&Value> = config["static_resources"]["clusters"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    // vLLM's server (uvicorn) closes a connection idle for 5 s: Envoy must let go of it first,
    // or a request written on a connection being closed is lost (a 503, and prefill's KV
    // stranded).
    for cluster in &clusters {
        let idle = &cluster["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            ["common_http_protocol_options"]["idle_timeout"];
        if !seconds(idle).is_some_and(|idle| idle > 0.0 && idle < 5.0) {
            errors.push(format!(
                "cluster {}: idle_timeout {idle}, not below vLLM's 5 s keep-alive",
                cluster["name"]
            ));
        }
    }
    // Outlier detection on any 5xx lets a client whose requests make vLLM answer 500 eject
    // workers for everyone: gateway failures (connections, 502/503/504) only.
    for cluster in &clusters {
        let outlier = &cluster["outlier_detection"];
        let enforced = |key: &str, default: u64| {
            outlier
                .get(key)
                .map_or(default, |value| value.as_u64().unwrap_or(100))
        };
        if outlier.is_object() && enforced("enforcing_consecutive_5xx", 100) != 0 {
            errors.push(format!(
                "cluster {}: outlier detection ejects on consecutive_5xx, which clients can cause",
                cluster["name"]
            ));
        }
    }
    let managers = http_connection_managers(config);
    if managers.is_empty() {
        errors.push("no HTTP connection manager".to_owned());
    }
    for (listener, hcm) in managers {
        let name = listener["name"].as_str().unwrap_or("?");
        let mut error = |what: String| errors.push(format!("listener {name}: {what}"));

        // Canonical paths before any filter or route sees them.
        for key in ["normalize_path", "merge_slashes"] {
            if hcm[key] != true {
                error(format!("{key} is not true"));
            }
        }
        let escaped = &hcm["path_with_escaped_slashes_action"];
        if escaped != "REJECT_REQUEST" && escaped != "UNESCAPE_AND_REDIRECT" {
            error(format!("path_with_escaped_slashes_action is {escaped}"));
        }

        // Envoy's own answers as OpenAI errors, the filter's (code details pd_filter) as the
        // filter wrote them: first mapper passes them on, the default body is an error object.
        let local_reply = &hcm["local_reply_config"];
        let first = &local_reply["mappers"][0];
        let passes_filters_own = first["filter"]["extension_filter"]["typed_config"]["expression"]
            == "response.code_details == 'pd_filter'"
            && first["body_format_override"]["text_format_source"]["inline_string"]
                == "%LOCAL_REPLY_BODY%";
        if !passes_filters_own {
            error("local_reply_config does not pass the filter's answers on first".to_owned());
        }
        let envoys = &local_reply["body_format"]["json_format"]["error"];
        if envoys["message"].is_null() || envoys["code"] != "%RESPONSE_CODE%" {
            error("local_reply_config does not answer an OpenAI error object".to_owned());
        }

        let underscores = &hcm["common_http_protocol_options"]["headers_with_underscores_action"];
        if underscores != "DROP_HEADER" && underscores != "REJECT_REQUEST" {
            error(format!(
                "headers_with_underscores_action is {underscores}: a worker-choosing header \
                 spelled with underscores passes"
            ));
        }

        let keep_after_400 =
            &hcm["http_protocol_options"]["override_stream_error_on_invalid_http_message"];
        if keep_after_400 != true {
            error(
                "http_protocol_options.override_stream_error_on_invalid_http_message is not \
                 true: every 400 the filter answers closes the client's HTTP/1.1 connection"
                    .to_owned(),
            );
        }
        let reset_alone =
            &hcm["http2_protocol_options"]["override_stream_error_on_invalid_http_message"];
        if reset_alone != true {
            error(
                "http2_protocol_options.override_stream_error_on_invalid_http_message is not \
                 true: one malformed HTTP/2 request ends every stream on its connection"
                    .to_owned(),
            );
        }

        if hcm["use_remote_address"] != true {
            error(
                "use_remote_address is not true: the client's own X-Forwarded-For would be \
                 its address, and it would choose whom abandoned prefills count against"
                    .to_owned(),
            );
        }

        if let Some(problem) = guard_problem(hcm) {
            error(problem);
        }
        if let Some(problem) = operator_endpoints_problem(hcm) {
            error(problem);
        }
        let retry_after_503 = hcm["local_reply_config"]["mappers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|mapper| {
                mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]
                    == 503
                    && mapper["headers_to_add"][0]["header"]["key"] == "retry-after"
            });
        if !retry_after_503 {
            error("Envoy's own 503s carry no retry-after".to_owned());
        }

        let filters = wasm_filters(hcm);
        // Every cluster the filter calls is one of this Envoy's: a missing prefill cluster
        // fails every request, a missing decode cluster every KV release, unseen.
        for (_, plugin) in &filters {
            let parsed = match Config::from_json(plugin.to_string().as_bytes()) {
                Ok(parsed) => parsed,
                Err(e) => {
                    error(format!("plugin configuration refused: {e}"));
                    continue;
                }
            };
            let mut called = vec![("prefill_cluster", parsed.prefill_cluster.clone())];
            called.extend(
                parsed
                    .prefill_host_cluster
                    .iter()
                    .map(|c| ("prefill_host_cluster", c.clone())),
            );
            for cluster in parsed.model_prefill_clusters.values() {
                called.push(("model_prefill_clusters", cluster.clone()));
            }
            if parsed.release_kv_on_abandon {
                called.push(("decode_cluster", parsed.decode_cluster.clone()));
                for cluster in parsed.model_decode_clusters.values() {
                    called.push(("model_decode_clusters", cluster.clone()));
                }
            }
            for (key, cluster) in called {
                if !clusters
                    .iter()
                    .any(|defined| defined["name"] == cluster.as_str())
                {
                    error(format!("{key} {cluster:?} is not a cluster of this Envoy"));
                }
            }
        }

        // Slow clients, with the filter's prefill budget inside the request timeout.
        let prefill_timeout_s = filters
            .iter()
            .map(|(_, plugin)| {
                plugin["prefill_timeout_ms"]
                    .as_u64()
                    .unwrap_or(DEFAULT_PREFILL_TIMEOUT_MS)
            })
            .max()
            .unwrap_or(DEFAULT_PREFILL_TIMEOUT_MS) as f64
            / 1000.0;
        match seconds(&hcm["request_headers_timeout"]) {
            Some(s) if s > 0.0 && s <= 60.0 => {}
            _ => error(format!(
                "request_headers_timeout {} (want 0 < t <= 60s)",
                hcm["request_headers_timeout"]
            )),
        }
        match seconds(&hcm["request_timeout"]) {
            Some(s) if s >= prefill_timeout_s + 60.0 && s <= 3600.0 => {}
            _ => error(format!(
                "request_timeout {} (want at least prefill_timeout_ms + 60s = {}s, at most 1h)",
                hcm["request_timeout"],
                prefill_timeout_s + 60.0
            )),
        }
        // The idle timer runs while prefill works: below the prefill timeout, a long prefill
        // gets Envoy's 504 instead of the filter's answer.
        match seconds(&hcm["stream_idle_timeout"]) {
            Some(s) if s > prefill_timeout_s => {}
            _ => error(format!(
                "stream_idle_timeout {} (want above prefill_timeout_ms = {}s)",
                hcm["stream_idle_timeout"], prefill_timeout_s
            )),
        }

        // HTTP/2: bounded streams per connection and flow-control windows.
        let http2 = &hcm["http2_protocol_options"];
        if !http2["max_concurrent_streams"]
            .as_u64()
            .is_some_and(|n| (1..=1024).contains(&n))
        {
            error(format!(
                "http2 max_concurrent_streams {} (want 1..=1024)",
                http2["max_concurrent_streams"]
            ));
        }
        let stream_window = http2["initial_stream_window_size"].as_u64();
        let connection_window = http2["initial_connection_window_size"].as_u64();
        if !stream_window.is_some_and(|w| (65_535..=16 << 20).contains(&w))
            || !connection_window.is_some_and(|w| w >= stream_window.unwrap_or(0) && w <= 64 << 20)
        {
            error(format!(
                "http2 windows {stream_window:?}/{connection_window:?} (want stream <= 16 MiB <= \
                 connection <= 64 MiB)"
            ));
        }

        // A client that pauses its reading keeps its token streams (one frame per token).
        if http2["max_outbound_frames"]
            .as_u64()
            .is_none_or(|frames| frames < 100_000)
        {
            error(format!(
                "http2 max_outbound_frames {} (want >= 100000)",
                http2["max_outbound_frames"]
            ));
        }

        // Every answer carries the request id both legs logged, Envoy's own too.
        if hcm["always_set_request_id_in_response"] != true {
            error(
                "Envoy's own answers without the request id (always_set_request_id_in_response)"
                    .to_owned(),
            );
        }

        // The worker-choosing headers removed before any filter runs, by name or prefix.
        let mutations: Vec<Value> = hcm["early_header_mutation_extensions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|extension| {
                extension["name"] == "envoy.http.early_header_mutation.header_mutation"
            })
            .flat_map(|extension| {
                extension["typed_config"]["mutations"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        let removed = |header: &str| {
            mutations.iter().any(|mutation| {
                let by_name = mutation["remove"].as_str();
                let by_prefix = mutation["remove_on_match"]["key_matcher"]["prefix"].as_str();
                by_name.is_some_and(|name| name.eq_ignore_ascii_case(header))
                    || by_prefix.is_some_and(|prefix| header.starts_with(prefix))
            })
        };
        let mut trusted: Vec<String> = TRUSTED_HEADERS
            .iter()
            .chain(&ENVOY_ROUTING_HEADERS)
            .map(|h| h.to_string())
            .collect();
        for (_, plugin) in &filters {
            for key in ["prefill_host_header", "model_header"] {
                if let Some(header) = plugin[key].as_str() {
                    trusted.push(header.to_ascii_lowercase());
                }
            }
        }
        for header in trusted {
            if !removed(&header) {
                error(format!(
                    "client copies of {header} are not removed early (early_header_mutation_extensions)"
                ));
            }
        }

        // Orchestrated requests' headers held until prefill has answered (no decode stream
        // for a request still uploading or in prefill), which needs Envoy to let the filter
        // stop at the headers without holding the body from it.
        for (wasm, plugin) in &filters {
            let holds =
                plugin["hold_request_headers"] == true || plugin["model_header"].is_string();
            if plugin["hold_request_headers"] != true {
                error("the filter does not hold request headers (hold_request_headers)".to_owned());
            }
            if holds && wasm["allow_on_headers_stop_iteration"] != true {
                error(
                    "headers held without allow_on_headers_stop_iteration: every request would hang"
                        .to_owned(),
                );
            }
        }

        // What Envoy holds for each client connection, the answer a slow reader has not
        // taken among it, stays at Envoy's default; bodies are buffered per virtual host.
        let connection_buffer = listener["per_connection_buffer_limit_bytes"]
            .as_u64()
            .unwrap_or(ENVOY_DEFAULT_BUFFER_LIMIT as u64);
        if connection_buffer > ENVOY_DEFAULT_BUFFER_LIMIT as u64 {
            error(format!(
                "per_connection_buffer_limit_bytes {connection_buffer} above 1 MiB: Envoy holds \
                 that much of an answer for every client that reads slowly"
            ));
        }
        // The body buffer holds the largest body the filter accepts, on every virtual host
        // and every route (a route's own limit replaces its virtual host's), and more by
        // what Envoy reads from a client at once: Envoy adds each piece to the body before
        // the filter sees it, so only then is an undeclared upload over the filter's limit
        // answered by the filter (its 413, in the API's shape) rather than by Envoy.
        let set_limit = |at: &Value| {
            [
                "request_body_buffer_limit",
                "per_request_buffer_limit_bytes",
            ]
            .iter()
            .filter_map(|field| at[*field].as_u64())
            .min()
        };
        let body_buffer = hcm["route_config"]["virtual_hosts"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|host| {
                let host_limit = set_limit(host).unwrap_or(0).max(connection_buffer);
                let routes = host["routes"].as_array().into_iter().flatten();
                std::iter::once(host_limit)
                    .chain(routes.map(move |route| set_limit(route).unwrap_or(host_limit)))
            })
            .min()
            .unwrap_or(connection_buffer);
        for (wasm, plugin) in &filters {
            let max_body = plugin["max_request_body_bytes"]
                .as_u64()
                .unwrap_or(DEFAULT_MAX_REQUEST_BODY_BYTES);
            if body_buffer < max_body + connection_buffer {
                error(format!(
                    "request_body_buffer_limit {body_buffer} < max_request_body_bytes {max_body} \
                     + per_connection_buffer_limit_bytes {connection_buffer}"
                ));
            }
            // For an HTTP/2 client, Envoy buffers a stream up to its window (the virtual
            // host's body buffer raises that), and the heap monitor's resets keep open
            // uploads in check only with a window that holds the body: with 1 MiB and 4 MiB
            // windows, 400 uploads grew Envoy to 2 GB and more under a 300 MB limit.
            if stream_window.is_some_and(|window| window < max_body) {
                error(format!(
                    "http2 initial_stream_window_size {stream_window:?} < max_request_body_bytes \
                     {max_body}"
                ));
            }
            if wasm["failure_policy"] != "FAIL_RELOAD" {
                error(format!("wasm failure_policy {}", wasm["failure_policy"]));
            }
            // A scheduler-named prefill host is honoured only within an allow-list that keeps
            // Envoy's own loopback (its admin endpoint) out.
            if plugin.get("prefill_host_cluster").is_some() {
                match plugin["prefill_hosts_allowed"].as_array() {
                    Some(entries) if !entries.is_empty() => {
                        for entry in entries {
                            let entry = entry.as_str().unwrap_or("");
                            let loopback = ["127.0.0.1", "::1"]
                                .map(|ip| ip.parse().expect("ip"))
                                .into_iter()
                                .any(|ip| allows(entry, ip));
                            if loopback {
                                error(format!(
                                    "prefill_hosts_allowed entry {entry:?} allows loopback"
                                ));
                            }
                        }
                    }
                    _ => error("prefill_host_cluster without prefill_hosts_allowed".to_owned()),
                }
            }
        }

        // Routes: no overall timeout (long generations), and never to an address a client
        // names (an ORIGINAL_DST cluster).
        for host in hcm["route_config"]["virtual_hosts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            for route in host["routes"].as_array().into_iter().flatten() {
                // Envoy's own answer (vLLM's operator endpoints) goes nowhere.
                if route["direct_response"].is_object() {
                    continue;
                }
                let Some(target) = route["route"]["cluster"].as_str() else {
                    error(format!("a route without a cluster: {route}"));
                    continue;
                };
                if route["route"]["timeout"] != "0s" {
                    error(format!(
                        "route to {target}: timeout {}",
                        route["route"]["timeout"]
                    ));
                }
                match clusters.iter().find(|cluster| cluster["name"] == target) {
                    Some(cluster) if cluster["type"] == "ORIGINAL_DST" => error(format!(
                        "route to the ORIGINAL_DST cluster {target}: a request header names any address"
                    )),
                    Some(cluster) if route["route"]["retry_policy"].is_object() => {
                        // Envoy lets 3 retries run at once by default: under load, a retry
                        // from a dead host to a live one is turned away (retry_overflow).
                        let max_retries = cluster["circuit_breakers"]["thresholds"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(|threshold| threshold["max_retries"].as_u64())
                            .max()
                            .unwrap_or(3);
                        if max_retries < 1024 {
                            error(format!(
                                "route to {target} retries, but the cluster lets {max_retries} \
                                 retries run at once (circuit_breakers max_retries)"
                            ));
                        }
                    }
                    Some(_) => {}
                    None => error(format!("route to a missing cluster {target}")),
                }
            }
        }
    }
    errors
}

#[test]
fn every_envoy_config_keeps_the_hardening() {
    let configs = envoy_configs();
    assert_eq!(
        configs.len(),
        6,
        "shipped Envoy configurations: {configs:?}"
    );
    let mut failures = Vec::new();
    for path in &configs {
        let relative = path.strip_prefix(repo_root()).unwrap_or(path);
        let text = std::fs::read_to_string(path).expect("config");
        let documents = yaml_documents(&text, &relative.display().to_string());
        assert_eq!(documents.len(), 1, "{}", relative.display());
        for error in hardening_errors(&documents[0]) {
            failures.push(format!("{}: {error}", relative.display()));
        }
        // Envoy's own answers are written the same way everywhere: as envoy.yaml does.
        let reference = yaml_file("envoy/envoy.yaml").remove(0);
        for (_, hcm) in http_connection_managers(&documents[0]) {
            let reference_hcm = http_connection_managers(&reference)
                .first()
                .map(|(_, hcm)| hcm["local_reply_config"].clone());
            if reference_hcm.as_ref() != Some(&hcm["local_reply_config"]) {
                failures.push(format!(
                    "{}: local_reply_config differs from envoy/envoy.yaml's",
                    relative.display()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// What is weakened, an excerpt of the error it must cause, and how to weaken a configuration.
type Weakening = Edit;

fn first_hcm(config: &mut Value) -> &mut Value {
    &mut config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]
}

#[test]
fn weakened_envoy_configs_are_caught() {
    let valid = yaml_file("envoy/envoy.yaml").remove(0);
    assert!(hardening_errors(&valid).is_empty());
    let weakenings: &[Weakening] = &[
        ("paths kept as sent", "normalize_path", |c| {
            first_hcm(c)
                .as_object_mut()
                .unwrap()
                .remove("normalize_path");
        }),
        ("slashes not merged", "merge_slashes", |c| {
            first_hcm(c)["merge_slashes"] = json!(false)
        }),
        ("encoded slashes forwarded", "KEEP_UNCHANGED", |c| {
            first_hcm(c)["path_with_escaped_slashes_action"] = json!("KEEP_UNCHANGED")
        }),
        ("no header timeout", "request_headers_timeout", |c| {
            first_hcm(c)
                .as_object_mut()
                .unwrap()
                .remove("request_headers_timeout");
        }),
        (
            "a request timeout inside the prefill budget",
            "request_timeout",
            |c| first_hcm(c)["request_timeout"] = json!("120s"),
        ),
        (
            "an idle timeout inside the prefill budget",
            "stream_idle_timeout",
            |c| first_hcm(c)["stream_idle_timeout"] = json!("60s"),
        ),
        ("unbounded HTTP/2 streams", "max_concurrent_streams", |c| {
            first_hcm(c)["http2_protocol_options"]
                .as_object_mut()
                .unwrap()
                .remove("max_concurrent_streams");
        }),
        (
            "open streams never reset near the heap limit",
            "reset_high_memory_stream",
            |c| {
                let actions = c["overload_manager"]["actions"].as_array_mut().unwrap();
                actions.retain(|action| {
                    action["name"] != "envoy.overload_actions.reset_high_memory_stream"
                });
            },
        ),
        (
            "answers without the request id",
            "always_set_request_id_in_response",
            |c| {
                first_hcm(c)
                    .as_object_mut()
                    .unwrap()
                    .remove("always_set_request_id_in_response");
            },
        ),
        ("Envoy's default HTTP/2 windows", "http2 windows", |c| {
            first_hcm(c)["http2_protocol_options"]["initial_stream_window_size"] =
                json!(268_435_456)
        }),
        (
            "an HTTP/2 stream window below the body limit",
            "initial_stream_window_size Some(1048576)",
            |c| {
                first_hcm(c)["http2_protocol_options"]["initial_stream_window_size"] =
                    json!(1_048_576)
            },
        ),
        (
            "a scheduler header kept",
            "x-gateway-destination-endpoint",
            |c| {
                let mutations = &mut first_hcm(c)["early_header_mutation_extensions"][0]
                    ["typed_config"]["mutations"];
                mutations
                    .as_array_mut()
                    .unwrap()
                    .retain(|m| m["remove"] != "x-gateway-destination-endpoint");
            },
        ),
        ("the filter's x-pd- headers kept", "x-pd-anything", |c| {
            let mutations = &mut first_hcm(c)["early_header_mutation_extensions"][0]
                ["typed_config"]["mutations"];
            mutations
                .as_array_mut()
                .unwrap()
                .retain(|m| m["remove_on_match"].is_null());
        }),
        (
            "the filter's own host header kept",
            "x-scheduler-prefill",
            |c| {
                let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
                wasm["configuration"]["value"] =
                    json!(r#"{"prefill_host_header":"x-scheduler-prefill"}"#);
            },
        ),
        (
            "KV releases sent to a cluster Envoy does not have",
            "decode_cluster \"decode-pool\" is not a cluster",
            |c| {
                let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
                wasm["configuration"]["value"] =
                    json!(r#"{"hold_request_headers":true,"decode_cluster":"decode-pool"}"#);
            },
        ),
        (
            "idle connections kept an hour near the connection limit",
            "reduce_timeouts",
            |c| {
                c["overload_manager"]["actions"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|a| a["name"] != "envoy.overload_actions.reduce_timeouts");
            },
        ),
        (
            "connections closed after every 400",
            "override_stream_error_on_invalid_http_message",
            |c| {
                first_hcm(c)["http_protocol_options"]
                    .as_object_mut()
                    .unwrap()
                    .remove("override_stream_error_on_invalid_http_message");
            },
        ),
        (
            "HTTP/2 connections ended by one malformed stream",
            "one malformed HTTP/2 request ends every stream",
            |c| {
                first_hcm(c)["http2_protocol_options"]
                    .as_object_mut()
                    .unwrap()
                    .remove("override_stream_error_on_invalid_http_message");
            },
        ),
        (
            "headers with underscores passed on",
            "headers_with_underscores_action",
            |c| {
                first_hcm(c)
                    .as_object_mut()
                    .unwrap()
                    .remove("common_http_protocol_options");
            },
        ),
        (
            "the client's X-Forwarded-For taken as its address",
            "use_remote_address",
            |c| {
                first_hcm(c)
                    .as_object_mut()
                    .unwrap()
                    .remove("use_remote_address");
            },
        ),
        ("silent connections kept open", "never sends a byte", |c| {
            c["static_resources"]["listeners"][0]
                .as_object_mut()
                .unwrap()
                .remove("listener_filters");
        }),
        (
            "no connection limit",
            "global_downstream_max_connections",
            |c| {
                c["overload_manager"]["resource_monitors"]
                    .as_array_mut()
                    .unwrap()
                    .retain(|m| {
                        m["name"] != "envoy.resource_monitors.global_downstream_max_connections"
                    });
            },
        ),
        (
            "headers passed to decode during prefill",
            "hold_request_headers",
            |c| {
                let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
                wasm["configuration"]["value"] = json!(r#"{"prefill_cluster":"prefill"}"#);
            },
        ),
        (
            "headers held where Envoy holds the body too",
            "every request would hang",
            |c| {
                let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
                wasm.as_object_mut()
                    .unwrap()
                    .remove("allow_on_headers_stop_iteration");
            },
        ),
        ("no heap limit", "fixed_heap", |c| {
            c["overload_manager"]
                .as_object_mut()
                .unwrap()
                .remove("actions");
        }),
        (
            "a body buffer below the body limit",
            "request_body_buffer_limit",
            |c| {
                first_hcm(c)["route_config"]["virtual_hosts"][0]
                    .as_object_mut()
                    .unwrap()
                    .remove("request_body_buffer_limit");
            },
        ),
        (
            "a body buffer no larger than the body limit",
            "request_body_buffer_limit",
            |c| {
                first_hcm(c)["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] =
                    json!(8_388_608)
            },
        ),
        (
            "a route's body buffer below the body limit",
            "request_body_buffer_limit",
            |c| {
                first_hcm(c)["route_config"]["virtual_hosts"][0]["routes"][0]
                    ["request_body_buffer_limit"] = json!(1_048_576)
            },
        ),
        (
            "a connection buffer that slow readers fill",
            "per_connection_buffer_limit_bytes",
            |c| {
                c["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] =
                    json!(16_777_216)
            },
        ),
        ("a route timeout", "timeout \"15s\"", |c| {
            let routes = first_hcm(c)["route_config"]["virtual_hosts"][0]["routes"]
                .as_array_mut()
                .unwrap();
            routes.last_mut().unwrap()["route"]["timeout"] = json!("15s")
        }),
        (
            "a route to an address the client names",
            "ORIGINAL_DST",
            |c| {
                c["static_resources"]["clusters"][1] = json!({
                    "name": "decode",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": { "use_http_header": true }
                });
            },
        ),
        (
            "scheduler hosts without an allow-list",
            "prefill_hosts_allowed",
            |c| {
                let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
                wasm["configuration"]["value"] = json!(r#"{"prefill_host_cluster":"picked"}"#);
            },
        ),
        (
            "upstream connections kept past vLLM's keep-alive",
            "keep-alive",
            |c| {
                c["static_resources"]["clusters"][1]
                    .as_object_mut()
                    .unwrap()
                    .remove("typed_extension_protocol_options");
            },
        ),
        ("workers ejected on any 5xx", "consecutive_5xx", |c| {
            c["static_resources"]["clusters"][1]["outlier_detection"] =
                json!({ "consecutive_5xx": 5 });
        }),
        ("retries turned away under load", "max_retries", |c| {
            let routes = first_hcm(c)["route_config"]["virtual_hosts"][0]["routes"]
                .as_array_mut()
                .unwrap();
            routes.last_mut().unwrap()["route"]["retry_policy"] =
                json!({ "retry_on": "connect-failure", "num_retries": 2 });
        }),
        ("no guard after the filter", "no pd-filter-guard", |c| {
            let filters = first_hcm(c)["http_filters"].as_array_mut().unwrap();
            filters.retain(|f| f["name"] != "pd-filter-guard");
        }),
        ("the guard before the filter", "not between", |c| {
            let filters = first_hcm(c)["http_filters"].as_array_mut().unwrap();
            let guard = filters.remove(1);
            filters.insert(0, guard);
        }),
        ("the guard reading another key", "no pd-filter-guard", |c| {
            first_hcm(c)["http_filters"][1]["typed_config"]["rules"]["policies"]
                ["pd-filter-did-not-run"]["principals"][0]["not_id"]["filter_state"]["key"] =
                json!("wasm.other");
        }),
        ("the guard's refusals as 403", "not answered 503", |c| {
            let mappers = first_hcm(c)["local_reply_config"]["mappers"]
                .as_array_mut()
                .unwrap();
            mappers.retain(|m| m["status_code"] != 503);
        }),
        (
            "vLLM's operator endpoints routed to decode",
            "operator endpoints",
            |c| {
                let routes = first_hcm(c)["route_config"]["virtual_hosts"][0]["routes"]
                    .as_array_mut()
                    .unwrap();
                routes.remove(0);
            },
        ),
        ("an allow-list with loopback", "allows loopback", |c| {
            let wasm = &mut first_hcm(c)["http_filters"][0]["typed_config"]["config"];
            wasm["configuration"]["value"] = json!(
                r#"{"prefill_host_cluster":"picked","prefill_hosts_allowed":["10.0.0.0/8","0.0.0.0/0"]}"#
            );
        }),
    ];
    assert_each_edit_is_caught("a configuration", &valid, weakenings, hardening_errors);
}

// ---------------------------------------------------------------------------------------------
// (e2) The labels of the filter's stats (README, "Observability").

/// The rule Istio's `extraStatTags` writes for a label: the filter's stat names carry their
/// labels in this form, so one Envoy rule and one Istio setting do the same.
fn istio_stat_tag_regex(label: &str) -> String {
    format!("({label}=\\.=(.*?);\\.;)")
}

/// Every shipped Envoy configuration turns the filter's `label=.=value;.;` name parts into
/// Prometheus labels, with the same rules as envoy/envoy.yaml (which the integration tests'
/// Envoy also uses), each the rule Istio writes for that label.
#[test]
fn every_envoy_config_labels_the_filters_stats() {
    let reference = yaml_file("envoy/envoy.yaml").remove(0)["stats_config"].clone();
    let tags = reference["stats_tags"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let labels: Vec<&str> = tags
        .iter()
        .filter_map(|tag| tag["tag_name"].as_str())
        .collect();
    assert_eq!(
        labels,
        ["api", "outcome", "kind"],
        "envoy/envoy.yaml stats_tags"
    );
    for tag in &tags {
        let label = tag["tag_name"].as_str().unwrap_or_default();
        assert_eq!(tag["regex"], istio_stat_tag_regex(label), "{tag}");
        assert_eq!(tag.as_object().map(|o| o.len()), Some(2), "{tag}");
    }
    let mut failures = Vec::new();
    for path in envoy_configs() {
        let relative = path
            .strip_prefix(repo_root())
            .unwrap_or(&path)
            .display()
            .to_string();
        let config = yaml_file(&relative).remove(0);
        if config["stats_config"] != reference {
            failures.push(format!("{relative}: {}", config["stats_config"]));
        }
    }
    assert!(
        failures.is_empty(),
        "stats_config unlike envoy/envoy.yaml's: {failures:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// (f) The Istio settings the filter depends on.

/// A rule of an AuthorizationPolicy that matches any request carrying `header`, whatever else
/// it carries.
fn rule_matches_header(rule: &Value, header: &str) -> bool {
    let key = format!("request.headers[{header}]");
    rule.get("from").is_none()
        && rule.get("to").is_none()
        && rule["when"].as_array().is_some_and(|conditions| {
            conditions.len() == 1
                && conditions[0]["key"]
                    .as_str()
                    .is_some_and(|k| k.eq_ignore_ascii_case(&key))
                && conditions[0]["values"] == json!(["*"])
                && conditions[0].get("notValues").is_none()
        })
}

#[test]
fn istio_manifests_require_path_normalization_and_refuse_scheduler_headers() {
    // vLLM decodes %2F; Istio's default normalization (BASE) keeps it.
    let operators = objects_of_kind("IstioOperator");
    assert_eq!(operators.len(), 1, "deploy/istio: one IstioOperator");
    assert_eq!(
        operators[0]["spec"]["meshConfig"]["pathNormalization"]["normalization"],
        "DECODE_AND_MERGE_SLASHES",
        "the mesh must decode %2F and merge slashes before the filter sees the path"
    );

    // Clients' copies of the worker-choosing headers are refused at the plugin's gateway (an
    // AuthorizationPolicy names headers one by one: the x-pd- names but x-pd-model, which
    // choose nothing, are left to the filter).
    let plugin = wasm_plugin();
    let mut trusted: Vec<String> = TRUSTED_HEADERS
        .iter()
        .filter(|header| **header != "x-pd-anything")
        .chain(&ENVOY_ROUTING_HEADERS)
        .map(|h| h.to_string())
        .collect();
    for key in ["prefill_host_header", "model_header"] {
        if let Some(header) = plugin["spec"]["pluginConfig"][key].as_str() {
            trusted.push(header.to_ascii_lowercase());
        }
    }
    let denials: Vec<Value> = objects_of_kind("AuthorizationPolicy")
        .into_iter()
        .filter(|policy| {
            policy["spec"]["action"] == "DENY"
                && policy["metadata"]["namespace"] == plugin["metadata"]["namespace"]
                && policy["spec"]["selector"] == plugin["spec"]["selector"]
        })
        .collect();
    for header in &trusted {
        assert!(
            denials.iter().any(|policy| {
                policy["spec"]["rules"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|rule| rule_matches_header(rule, header))
            }),
            "no DENY AuthorizationPolicy on the plugin's gateway refuses requests with {header}"
        );
    }
}

/// The EnvoyFilter of deploy/istio named `name`.
fn envoy_filter(name: &str) -> Value {
    let patches = objects_of_kind("EnvoyFilter");
    assert_eq!(patches.len(), 3, "deploy/istio: three EnvoyFilters");
    patches
        .into_iter()
        .find(|patch| patch["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("deploy/istio: no EnvoyFilter {name}"))
}

/// deploy/istio/routing.yaml puts envoy/envoy.yaml's guard on the plugin's gateway, before the
/// router and so after the WasmPlugin, which Istio places before its stats filter; and
/// before its own Gateway, so that the listener that opens is never without it.
#[test]
fn istio_guard_refuses_what_the_plugin_did_not_see() {
    let plugin = wasm_plugin();
    let patch = envoy_filter("pd-filter-guard");
    let routing: Vec<String> = yaml_file("deploy/istio/routing.yaml")
        .iter()
        .map(|object| format!("{}/{}", object["kind"], object["metadata"]["name"]))
        .collect();
    assert_eq!(
        routing.first().map(String::as_str),
        Some("\"EnvoyFilter\"/\"pd-filter-guard\""),
        "the guard comes first in routing.yaml, before the Gateway: {routing:?}"
    );
    assert_eq!(patch["apiVersion"], "networking.istio.io/v1alpha3");
    assert_eq!(
        patch["metadata"]["namespace"],
        plugin["metadata"]["namespace"]
    );
    assert_eq!(
        patch["spec"]["workloadSelector"]["labels"],
        plugin["spec"]["selector"]["matchLabels"]
    );
    let config_patches = patch["spec"]["configPatches"].as_array().expect("patches");
    assert_eq!(config_patches.len(), 1, "{config_patches:#?}");
    let config_patch = &config_patches[0];
    assert_eq!(config_patch["applyTo"], "HTTP_FILTER");
    assert_eq!(config_patch["match"]["context"], "GATEWAY");
    let filter = &config_patch["match"]["listener"]["filterChain"]["filter"];
    assert_eq!(
        filter["name"],
        "envoy.filters.network.http_connection_manager"
    );
    assert_eq!(filter["subFilter"]["name"], "envoy.filters.http.router");
    assert_eq!(config_patch["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(config_patch["patch"]["value"], pd_filter_guard());
    // The plugin runs in a phase before the router.
    assert_eq!(plugin["spec"]["phase"], "STATS");
}

#[test]
fn istio_local_replies_patch_the_gateway_with_envoy_yamls_block() {
    let typed_config = gateway_hcm_merge("pd-filter-local-replies");
    let reference = yaml_file("envoy/envoy.yaml").remove(0);
    let (_, hcm) = http_connection_managers(&reference)[0];
    assert_eq!(
        typed_config["local_reply_config"], hcm["local_reply_config"],
        "deploy/istio/local-replies.yaml must merge envoy/envoy.yaml's local_reply_config"
    );
    // Nothing else of the gateway's connection manager is touched.
    let keys: Vec<&String> = typed_config
        .as_object()
        .expect("typed_config")
        .keys()
        .collect();
    assert_eq!(keys, ["@type", "local_reply_config"]);
}

/// deploy/istio/gateway-limits.yaml gives the plugin's gateway envoy/envoy.yaml's limits on
/// slow clients, underscore spellings and HTTP/2, which Istio does not set.
#[test]
fn istio_gateway_limits_patch_the_gateway_with_envoy_yamls_values() {
    let typed_config = gateway_hcm_merge("pd-filter-gateway-limits");
    let reference = yaml_file("envoy/envoy.yaml").remove(0);
    let (_, hcm) = http_connection_managers(&reference)[0];
    let keys = [
        "request_headers_timeout",
        "request_timeout",
        "stream_idle_timeout",
        "common_http_protocol_options",
        "http2_protocol_options",
    ];
    for key in keys {
        assert_eq!(
            typed_config[key], hcm[key],
            "deploy/istio/gateway-limits.yaml: {key} as in envoy/envoy.yaml"
        );
    }
    // Of HTTP/1.1's options only the one that keeps a connection after a 400: Istio's
    // gateway sets its own for HTTP/1.0.
    let keep_after_400 = "override_stream_error_on_invalid_http_message";
    assert_eq!(
        typed_config["http_protocol_options"],
        json!({ keep_after_400: hcm["http_protocol_options"][keep_after_400] }),
        "deploy/istio/gateway-limits.yaml: http_protocol_options"
    );
    assert_eq!(hcm["http_protocol_options"][keep_after_400], true);
    let mut merged: Vec<&str> = typed_config
        .as_object()
        .expect("typed_config")
        .keys()
        .map(String::as_str)
        .collect();
    merged.sort_unstable();
    let mut expected = [&["@type", "http_protocol_options"][..], &keys[..]].concat();
    expected.sort_unstable();
    assert_eq!(merged, expected);
    // The plugin's body limit fits the HTTP/2 stream window.
    let body_limit = wasm_plugin()["spec"]["pluginConfig"]["max_request_body_bytes"]
        .as_u64()
        .expect("max_request_body_bytes");
    let window = typed_config["http2_protocol_options"]["initial_stream_window_size"]
        .as_u64()
        .expect("initial_stream_window_size");
    assert!(window >= body_limit, "{window} < {body_limit}");
}

/// The `typed_config` an EnvoyFilter of deploy/istio merges into the connection managers of
/// the plugin's gateway, and only there.
fn gateway_hcm_merge(name: &str) -> Value {
    let plugin = wasm_plugin();
    let patch = &envoy_filter(name);
    assert_eq!(patch["apiVersion"], "networking.istio.io/v1alpha3");
    assert_eq!(
        patch["metadata"]["namespace"], plugin["metadata"]["namespace"],
        "{name}: the EnvoyFilter must live beside the WasmPlugin"
    );
    assert_eq!(
        patch["spec"]["workloadSelector"]["labels"], plugin["spec"]["selector"]["matchLabels"],
        "{name}: the EnvoyFilter must select the plugin's gateway"
    );
    let config_patches = patch["spec"]["configPatches"]
        .as_array()
        .expect("configPatches");
    assert_eq!(config_patches.len(), 1, "{name}: {config_patches:#?}");
    let config_patch = &config_patches[0];
    assert_eq!(config_patch["applyTo"], "NETWORK_FILTER");
    assert_eq!(config_patch["match"]["context"], "GATEWAY");
    assert_eq!(
        config_patch["match"]["listener"]["filterChain"]["filter"]["name"],
        "envoy.filters.network.http_connection_manager"
    );
    assert_eq!(config_patch["patch"]["operation"], "MERGE");
    let typed_config = config_patch["patch"]["value"]["typed_config"].clone();
    assert_eq!(
        typed_config["@type"],
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    );
    typed_config
}

// ---------------------------------------------------------------------------------------------
// (g) The shipped configurations in a running Envoy, in front of the mock vLLM servers.

/// An Envoy started by a test; killed when dropped.
struct RunningEnvoy {
    child: std::process::Child,
    port: u16,
    admin_port: u16,
    log: PathBuf,
}

impl Drop for RunningEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RunningEnvoy {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// `text` with `from` replaced by `to`, which must occur: the test notices when a shipped
/// configuration changes under it.
fn substitute(text: &str, from: &str, to: &str) -> String {
    assert!(
        text.contains(from),
        "expected {from:?} in the configuration"
    );
    text.replace(from, to)
}

/// Starts Envoy with a shipped configuration whose listener and admin endpoint are moved to
/// free loopback ports (`edit` makes the other local changes), and waits for its listener.
fn start_shipped_envoy(
    relative: &str,
    label: &str,
    edit: impl Fn(String) -> String,
) -> RunningEnvoy {
    let dir = scratch_dir(label);
    let mut text = localize(&read(relative), &wasm_path(), &dir);
    for listener in [
        "address: 127.0.0.1, port_value: 10000",
        "address: 0.0.0.0, port_value: 10000",
    ] {
        text = text.replace(listener, "address: 127.0.0.1, port_value: 0");
    }
    text = substitute(&text, "port_value: 9901", "port_value: 0");
    let text = edit(text);
    let config = dir.join("envoy.yaml");
    std::fs::write(&config, text).expect("write config");
    let admin_path = dir.join("admin-address");
    let log = dir.join("envoy.log");
    let child = Command::new(envoy_binary())
        .arg("-c")
        .arg(&config)
        .args(["--concurrency", "1", "--use-dynamic-base-id", "-l", "info"])
        .arg("--admin-address-path")
        .arg(&admin_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("envoy log"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run envoy ({e}); run `make envoy` or set ENVOY_BIN"));
    let mut envoy = RunningEnvoy {
        child,
        port: 0,
        admin_port: 0,
        log,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = envoy.child.try_wait() {
            panic!("{relative}: envoy exited with {status}:\n{}", envoy.log());
        }
        let admin_port = std::fs::read_to_string(&admin_path)
            .ok()
            .and_then(|address| address.trim().rsplit(':').next()?.parse::<u16>().ok());
        let listener_port = admin_port
            .and_then(|admin| common::http_get(admin, "/listeners?format=json"))
            .and_then(|text| serde_json::from_str::<Value>(&text).ok())
            .and_then(|listeners| {
                listeners["listener_statuses"]
                    .as_array()?
                    .iter()
                    .find(|status| status["name"] == "openai")?["local_address"]["socket_address"]
                    ["port_value"]
                    .as_u64()
            })
            .filter(|port| *port != 0);
        if let (Some(admin_port), Some(port)) = (admin_port, listener_port) {
            envoy.admin_port = admin_port;
            envoy.port = port as u16;
            return envoy;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{relative}: envoy did not come up:\n{}",
            envoy.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// An answer as the client got it.
struct Reply {
    status: u16,
    /// The status line and headers, as sent.
    head: String,
    body: String,
}

impl Reply {
    /// The value of header `name` (the first, if repeated).
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name).then(|| value.trim())
        })
    }
}

/// One HTTP/1.1 POST of `body` as JSON, with the request target exactly as given (no
/// client-side normalization) and `headers` after the framing ones.
fn post_request(target: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut request = format!(
        "POST {target} HTTP/1.1\r\nhost: localhost\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    request
}

/// Sends one POST ([`post_request`]) on a connection closed after it, and reads the whole
/// answer.
fn raw_post(port: u16, target: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    let mut all = vec![("connection", "close")];
    all.extend_from_slice(headers);
    raw_exchange(port, post_request(target, &all, body).as_bytes())
}

/// Sends one POST ([`post_request`]) on a connection left open for the caller: to read the
/// answer later, or never.
fn open_post(port: u16, target: &str, headers: &[(&str, &str)], body: &str) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .write_all(post_request(target, headers, body).as_bytes())
        .expect("send");
    stream
}

/// Sends `request` as it is and reads the whole answer.
fn raw_exchange(port: u16, request: &[u8]) -> Reply {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    stream.write_all(request).expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read answer");
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {raw:?}"));
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        let mut decoded = String::new();
        let mut rest = rest;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if size == 0 || after.len() < size {
                break;
            }
            decoded.push_str(&after[..size]);
            rest = after.get(size + 2..).unwrap_or("");
        }
        decoded
    } else {
        rest.to_owned()
    };
    Reply {
        status,
        head: head.to_owned(),
        body,
    }
}

/// The `error` object of an OpenAI-style error answer with `status` and a message, or what
/// is wrong with the answer.
fn openai_error(reply: &Reply, status: u16) -> Result<Value, String> {
    if reply.status != status {
        return Err(format!(
            "status {} (want {status}): {:?}",
            reply.status, reply.body
        ));
    }
    let body: Value = serde_json::from_str(&reply.body)
        .map_err(|e| format!("not JSON ({e}): {:?}", reply.body))?;
    let error = &body["error"];
    let message = error["message"].as_str().unwrap_or_default();
    if message.is_empty() || message.starts_with('{') || error["code"] != status {
        return Err(format!("not an OpenAI error of its own: {body}"));
    }
    Ok(error.clone())
}

/// A tokio runtime that serves the mock vLLM servers while the test thread blocks on sockets.
fn mock_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn start_mock(runtime: &tokio::runtime::Runtime, role: mock_vllm::Role) -> mock_vllm::MockServer {
    runtime
        .block_on(mock_vllm::MockServer::start(role, "127.0.0.1:0"))
        .expect("mock server")
}

/// `envoy/envoy.yaml` as shipped, its clusters pointed at a prefill and a decode mock served
/// by the returned runtime.
fn envoy_yaml_before_mocks(
    label: &str,
) -> (
    tokio::runtime::Runtime,
    mock_vllm::MockServer,
    mock_vllm::MockServer,
    RunningEnvoy,
) {
    edited_envoy_yaml_before_mocks(label, |text| text)
}

/// As `envoy_yaml_before_mocks`, with `edit` made to the configuration.
fn edited_envoy_yaml_before_mocks(
    label: &str,
    edit: impl Fn(String) -> String,
) -> (
    tokio::runtime::Runtime,
    mock_vllm::MockServer,
    mock_vllm::MockServer,
    RunningEnvoy,
) {
    let runtime = mock_runtime();
    let prefill = start_mock(&runtime, mock_vllm::Role::Prefill);
    let decode = start_mock(&runtime, mock_vllm::Role::Decode);
    let envoy = start_shipped_envoy("envoy/envoy.yaml", label, |text| {
        let text = substitute(
            &text,
            "port_value: 8100 }",
            &format!("port_value: {} }}", prefill.port()),
        );
        edit(substitute(
            &text,
            "port_value: 8200 }",
            &format!("port_value: {} }}", decode.port()),
        ))
    });
    (runtime, prefill, decode, envoy)
}

/// envoy/envoy.yaml as shipped refuses a request Envoy runs without the wasm filter (as it
/// does on a worker where the plugin has no VM): a 503 the client may retry, and neither
/// prefill nor decode sees it. The filter is taken out of the configuration to stand for it.
#[test]
fn envoy_yaml_refuses_requests_the_filter_did_not_see_in_envoy() {
    let (_runtime, prefill, decode, envoy) =
        edited_envoy_yaml_before_mocks("run-envoy-yaml-unseen", |text| {
            let start = text
                .find("                  - name: envoy.filters.http.wasm")
                .expect("the wasm filter");
            let end = text
                .find("                  # Envoy leaves the wasm filter out")
                .expect("the guard's comment");
            format!("{}{}", &text[..start], &text[end..])
        });
    for (target, body) in [("/v1/completions", COMPLETION_BODY), ("/v1/models", "")] {
        let reply = raw_post(envoy.port, target, &[], body);
        let error = openai_error(&reply, 503).unwrap_or_else(|e| panic!("{target}: {e}"));
        assert_eq!(error["type"], "ServiceUnavailableError", "{target}");
        assert_eq!(reply.header("retry-after"), Some("1"), "{target}");
    }
    assert!(prefill.requests().is_empty(), "{:?}", prefill.requests());
    assert!(decode.requests().is_empty(), "{:?}", decode.requests());
    let denied = common::http_get(envoy.admin_port, "/stats?filter=pd_filter_guard.denied")
        .unwrap_or_default();
    assert!(
        denied.contains("rbac.pd_filter_guard.denied: 2"),
        "{denied}"
    );
}

/// envoy/envoy.yaml as shipped answers a request whose VM crashed (failure_policy
/// FAIL_RELOAD) with an OpenAI 503 that says what happened and when to retry, and serves the
/// next requests from a reloaded VM. A test module (test-modules/crashing-filter) stands for
/// the filter: pd-filter itself has no input that crashes it.
#[test]
fn envoy_yaml_answers_a_crashed_vm_and_reloads_it_in_envoy() {
    let crashing = repo_root().join("target/wasm32-wasip1/release/crashing_filter.wasm");
    assert!(
        crashing.exists(),
        "{} is missing: run `make test-modules` (make test does)",
        crashing.display()
    );
    let filter = wasm_path().display().to_string();
    let (_runtime, _prefill, decode, envoy) =
        edited_envoy_yaml_before_mocks("run-envoy-yaml-crash", |text| {
            substitute(&text, &filter, &crashing.display().to_string())
        });
    let reply = raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let reply = raw_post(
        envoy.port,
        "/v1/completions",
        &[("x-crash-vm", "1")],
        COMPLETION_BODY,
    );
    let error = openai_error(&reply, 503).unwrap_or_else(|e| panic!("{e}\n{}", envoy.log()));
    assert_eq!(error["type"], "ServiceUnavailableError");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains("failed on this Envoy worker"), "{message}");
    assert_eq!(reply.header("retry-after"), Some("1"));
    // The VM is reloaded for a later request (Envoy waits a little before it reloads).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let served = loop {
        let reply = raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY);
        if reply.status == 200 || std::time::Instant::now() > deadline {
            break reply;
        }
        openai_error(&reply, 503).unwrap_or_else(|e| panic!("while reloading: {e}"));
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(served.status, 200, "{}\n{}", served.body, envoy.log());
    assert_eq!(decode.requests().len(), 2, "{:?}", decode.requests());
}

/// envoy/envoy.yaml as shipped answers vLLM's operator endpoints 404 itself, however the
/// client spells the path, and serves the APIs beside them.
#[test]
fn envoy_yaml_keeps_vllms_operator_endpoints_from_clients_in_envoy() {
    let (_runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-operator");
    for target in [
        "/inference/v1/abort_requests",
        "/abort_requests",
        "/scale_elastic_ep",
        "/inference/v1/abort_requests/",
        "/inference/v1/abort_requests?x=1",
        "//inference//v1/abort_requests",
        "/inference/v1/../v1/abort_requests",
        "/inference/v1/%61bort_requests",
        "/v1/load_lora_adapter",
        "/v1/pd_kv_ready",
        "/drop_peer",
        "/v1/fault_tolerance/apply",
        "/checkpoint/prepare?mode=abort",
        "/kv_event_sources",
        "/adapters",
        "/adapters/x",
        "/pause/step",
        "/v1/requests/victim/cancel",
        "/internal/kv_connector_refresh_lease",
        "/v1/admin/drain",
        "/debug/sleep",
        "/dashboard",
        "/collective_rpc",
        "/sleep",
        "/fault_tolerance/apply",
        "/metrics",
        "/metrics/",
        "/metrics/x",
        "/metricsx",
        "/metrics;x",
        "/metrics%3Bx",
        "/metrics.txt",
        "/load",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    ] {
        let reply = raw_post(envoy.port, target, &[], r#"{"request_ids":["victim"]}"#);
        openai_error(&reply, 404).unwrap_or_else(|e| panic!("{target}: {e}"));
    }
    assert!(decode.requests().is_empty(), "{:?}", decode.requests());
    // Beside them, the APIs still reach decode.
    let reply = raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY);
    assert_eq!(reply.status, 200, "{}", reply.body);
}

/// envoy/envoy.yaml as shipped says why it refuses what it does not route (CONNECT), protocol
/// upgrades, a request without a Host header and one whose target is not a path (`*`),
/// which Envoy answers without any text of its own.
#[test]
fn envoy_yaml_says_why_it_refuses_connect_and_upgrades_in_envoy() {
    let (_runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-upgrade");
    let connect = raw_exchange(
        envoy.port,
        b"CONNECT 127.0.0.1:9901 HTTP/1.1\r\nhost: 127.0.0.1:9901\r\nconnection: close\r\n\r\n",
    );
    let error = openai_error(&connect, 404).unwrap_or_else(|e| panic!("CONNECT: {e}"));
    assert_eq!(error["type"], "route_not_found", "{error}");
    let upgrade = raw_post(
        envoy.port,
        "/v1/completions",
        &[
            ("upgrade", "websocket"),
            ("connection", "upgrade"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ],
        COMPLETION_BODY,
    );
    let error = openai_error(&upgrade, 403).unwrap_or_else(|e| panic!("upgrade: {e}"));
    assert_eq!(error["type"], "upgrade_failed", "{error}");
    for (request, status, details) in [
        (
            &b"POST /v1/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"[..],
            400,
            "missing_host_header",
        ),
        (
            &b"OPTIONS * HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n"[..],
            404,
            "absolute_path_rejected",
        ),
    ] {
        let reply = raw_exchange(envoy.port, request);
        let error = openai_error(&reply, status).unwrap_or_else(|e| panic!("{details}: {e}"));
        assert_eq!(error["type"], details, "{error}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{details}: {error}");
    }
    assert!(decode.requests().is_empty(), "{:?}", decode.requests());
}

/// envoy/envoy.yaml as shipped answers with its own 503 when decode cannot be reached, as
/// OpenAI JSON with `retry-after: 1`, as the filter's own 503s.
#[test]
fn envoy_yaml_says_when_to_retry_its_own_503_in_envoy() {
    let (runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-503");
    // Decode goes away: its port refuses connections.
    runtime.block_on(async move { drop(decode) });
    std::thread::sleep(std::time::Duration::from_millis(200));
    for (target, body) in [("/v1/models", ""), ("/v1/completions", COMPLETION_BODY)] {
        let reply = raw_post(envoy.port, target, &[], body);
        openai_error(&reply, 503).unwrap_or_else(|e| panic!("{target}: {e}"));
        assert_eq!(reply.header("retry-after"), Some("1"), "{target}");
    }
}

/// envoy/envoy.yaml as shipped, its connection limit lowered to 20: connections that never
/// send a byte are closed after 10 s, and connections left idle after a request give way
/// within seconds once the limit is near, so that one client's sockets cannot shut the others
/// out for Envoy's hour of idle time.
#[test]
fn envoy_yaml_lets_silent_and_idle_connections_go_near_its_limit_in_envoy() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::{Duration, Instant};
    let (_runtime, _prefill, _decode, envoy) =
        edited_envoy_yaml_before_mocks("run-envoy-yaml-idle", |text| {
            substitute(
                &text,
                "max_active_downstream_connections: 10000",
                "max_active_downstream_connections: 20",
            )
        });
    let open = |count: usize, request: Option<&[u8]>| -> Vec<TcpStream> {
        (0..count)
            .map(|_| {
                let mut stream = TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
                if let Some(request) = request {
                    stream.write_all(request).expect("send");
                    let mut answer = [0u8; 4096];
                    let read = stream.read(&mut answer).expect("answer");
                    assert!(answer[..read].starts_with(b"HTTP/1.1 404"));
                }
                stream
            })
            .collect()
    };
    let closed_by_envoy = |streams: &mut [TcpStream], within: Duration| {
        let deadline = Instant::now() + within;
        for stream in streams.iter_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .expect("timeout");
            let mut byte = [0u8; 1];
            assert!(
                matches!(stream.read(&mut byte), Ok(0) | Err(_)) && Instant::now() < deadline,
                "a connection still open after {within:?}"
            );
        }
    };
    let served = || raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY).status == 200;

    // 19 of 20 connections idle after one request each: their idle time shrinks to 5 s.
    let request = b"GET /nothing HTTP/1.1\r\nhost: localhost\r\n\r\n";
    let mut idle = open(19, Some(request));
    closed_by_envoy(&mut idle, Duration::from_secs(12));
    assert!(served());

    // 20 sockets that never send a byte fill the limit; 10 s later they are gone.
    let mut silent = open(20, None);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        std::panic::catch_unwind(served).map_or(true, |served| !served),
        "a client was served past the connection limit"
    );
    closed_by_envoy(&mut silent, Duration::from_secs(12));
    assert!(served());
}

/// envoy/envoy.yaml as shipped: decode's JSON answer cut off after its headers came (held by
/// the filter for the usage merge) is a 502 that says so, rather than Envoy's "reset before
/// headers".
#[test]
fn envoy_yaml_says_when_decodes_answer_was_cut_off_in_envoy() {
    let (_runtime, _prefill, _decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-cut");
    let body = r#"{"model":"m","prompt":"cut mock:decode_reset_mid_stream","max_tokens":20}"#;
    let reply = raw_post(envoy.port, "/v1/completions", &[], body);
    let error = openai_error(&reply, 502).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|message| message.starts_with("decode's answer was cut off")),
        "{error}"
    );
    assert!(
        error["type"]
            .as_str()
            .is_some_and(|kind| kind.starts_with("upstream_reset_after_response_started")),
        "{error}"
    );
}

/// envoy/envoy.yaml takes the connection's peer as the client, never what the client's own
/// X-Forwarded-For says: a client that leaves prefills running under a new X-Forwarded-For
/// each time still reaches its limit of abandoned prefills (32 per worker), and is refused.
#[test]
fn envoy_yaml_counts_abandoned_prefills_by_the_peer_not_its_x_forwarded_for_in_envoy() {
    let (_runtime, _prefill, _decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-xff");
    let leaving: Vec<std::net::TcpStream> = (0..40)
        .map(|n| {
            let body = format!(
                r#"{{"model":"m","prompt":"leaves {n} mock:prefill_delay_ms=4000","max_tokens":2}}"#
            );
            let forged = format!("198.51.100.{n}");
            open_post(
                envoy.port,
                "/v1/completions",
                &[("x-forwarded-for", &forged)],
                &body,
            )
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(500));
    drop(leaving);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let reply = raw_post(
        envoy.port,
        "/v1/completions",
        &[("x-forwarded-for", "203.0.113.9")],
        COMPLETION_BODY,
    );
    openai_error(&reply, 429).unwrap_or_else(|e| panic!("{e}"));
}

/// envoy/envoy.yaml removes a client's Envoy routing headers even where Envoy would count
/// the client as internal and obey them: a retry on 200 would send decode the same KV again.
#[test]
fn envoy_yaml_ignores_a_clients_retry_headers_even_from_an_internal_address_in_envoy() {
    let (_runtime, prefill, decode, envoy) = edited_envoy_yaml_before_mocks(
        "run-envoy-yaml-internal",
        |text| {
            substitute(
                &text,
                "                use_remote_address: true\n",
                "                use_remote_address: true\n                internal_address_config: { cidr_ranges: [{ address_prefix: 127.0.0.0, prefix_len: 8 }] }\n",
            )
        },
    );
    let id = "internal-client-retries";
    let reply = raw_post(
        envoy.port,
        "/v1/completions",
        &[
            ("x-request-id", id),
            ("x-envoy-retry-on", "retriable-status-codes"),
            ("x-envoy-retriable-status-codes", "200"),
            ("x-envoy-max-retries", "3"),
            ("x-envoy-upstream-rq-timeout-ms", "1"),
        ],
        COMPLETION_BODY,
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(prefill.requests_with_id(id).len(), 1);
    let decoded = decode.requests_with_id(id);
    assert_eq!(decoded.len(), 1, "decode got the request more than once");
    for header in ENVOY_ROUTING_HEADERS {
        assert_eq!(decoded[0].header(header), None, "{header} reached decode");
    }
}

/// An Envoy whose wasm filter lacks `allow_on_headers_stop_iteration` never gives a held
/// request its body, and every orchestrated request hangs: the filter says why in Envoy's log
/// once held requests have come for 10 s and none has had its body.
#[test]
fn a_missing_allow_on_headers_stop_iteration_is_named_in_the_log_in_envoy() {
    let (_runtime, _prefill, decode, envoy) =
        edited_envoy_yaml_before_mocks("run-envoy-yaml-no-allow", |text| {
            substitute(&text, "allow_on_headers_stop_iteration: true", "")
        });
    let hanging = |n: u32| {
        let body = format!(r#"{{"model":"m","prompt":"held {n}","max_tokens":2}}"#);
        open_post(envoy.port, "/v1/completions", &[], &body)
    };
    // Connections spread over Envoy's two workers, each with its own check: enough of each
    // kind that both workers get some.
    let _first: Vec<_> = (0..12).map(hanging).collect();
    // Requests the filter does not hold get their bodies regardless: they say nothing of
    // held ones.
    let passed_through: Vec<_> = (0..12)
        .map(|n| {
            let body = format!(r#"{{"model":"m","input":"passed {n}"}}"#);
            open_post(envoy.port, "/v1/embeddings", &[], &body)
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(10_200));
    for mut stream in passed_through {
        use std::io::Read;
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).expect("an answer");
        assert!(
            head.starts_with(b"HTTP/1.1 "),
            "passed through and answered"
        );
    }
    let _second: Vec<_> = (12..24).map(hanging).collect();
    // A held request counts once it has had a second to get its body: the next ones say it.
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    let _third: Vec<_> = (24..36).map(hanging).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !envoy
        .log()
        .contains("allow_on_headers_stop_iteration: true")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no line names the missing setting:\n{}",
            envoy.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        !decode
            .requests()
            .iter()
            .any(|request| String::from_utf8_lossy(&request.body).contains("held")),
        "held requests never reach decode"
    );
}

/// envoy/envoy.yaml as shipped: clients slow to send their bodies, with requests served after
/// them, are no reason for the warning about `allow_on_headers_stop_iteration`.
#[test]
fn slow_uploads_raise_no_warning_about_held_headers_in_envoy() {
    use std::io::Write;
    let (_runtime, _prefill, _decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-slow");
    let _slow: Vec<std::net::TcpStream> = (0..6)
        .map(|_| {
            let mut stream =
                std::net::TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
            let head = "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n\
                        content-type: application/json\r\ncontent-length: 60\r\n\r\n";
            stream.write_all(head.as_bytes()).expect("send");
            stream
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(11_000));
    for _ in 0..6 {
        let reply = raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY);
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    let reply = raw_post(envoy.port, "/v1/completions", &[], COMPLETION_BODY);
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        !envoy
            .log()
            .contains("gives a held request its body only when"),
        "{}",
        envoy.log()
    );
}

const COMPLETION_BODY: &str = r#"{"model":"mock-model","prompt":"Hello there","max_tokens":4}"#;

/// envoy/envoy.yaml as shipped takes an HTTP/2 client's body up to the filter's limit: Envoy
/// buffers an HTTP/2 stream up to its flow-control window, not the listener's buffer limit.
#[test]
fn envoy_yaml_takes_http2_bodies_up_to_the_filters_limit_in_envoy() {
    use raw_http::{h2_connect, h2_exchange, H2Outcome, H2Request};
    let (runtime, prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-h2");
    let prompt = "word ".repeat(600_000);
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2}).to_string();
    assert!(body.len() > 2_900_000);
    let outcome = runtime.block_on(async {
        let sender = h2_connect(envoy.port).await.expect("h2c");
        let request = H2Request {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("x-request-id".into(), "h2-large-body".into()),
            ],
            data: body.as_bytes().chunks(16_384).map(<[u8]>::to_vec).collect(),
            trailers: vec![],
            reset_after: None,
        };
        h2_exchange(&sender, request, std::time::Duration::from_secs(60)).await
    });
    let H2Outcome::Response(response) = outcome else {
        panic!("no answer: {outcome:?}\n{}", envoy.log());
    };
    assert_eq!(response.status, 200, "{}", response.text());
    assert_eq!(prefill.requests_with_id("h2-large-body").len(), 1);
    assert_eq!(decode.requests_with_id("h2-large-body").len(), 1);
}

/// envoy/envoy.yaml as shipped answers an upload over the filter's limit whose length was not
/// declared with the filter's own 413, in the API's shape (Anthropic's on /v1/messages): Envoy
/// adds each piece it reads to the body before the filter sees it, and only a buffer above the
/// filter's limit by more than such a piece (twice it, as shipped) leaves the answer to the
/// filter. With equal limits these uploads get Envoy's 413 (README, max_request_body_bytes).
#[test]
fn envoy_yaml_answers_an_undeclared_upload_over_the_limit_itself_in_envoy() {
    const LIMIT: usize = 8 * 1024 * 1024;
    let (_runtime, prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-chunked-413");
    for (size, chunk) in [
        (LIMIT + 1, 64 * 1024),
        (LIMIT + 300_000, 16 * 1024),
        (12 * 1024 * 1024, 256 * 1024),
        (17 * 1024 * 1024, 1024 * 1024),
    ] {
        let id = format!("chunked-{size}-{chunk}");
        let head = r#"{"model":"mock-model","max_tokens":3,"messages":[{"role":"user","content":""#;
        let tail = r#""}]}"#;
        let mut body = head.as_bytes().to_vec();
        body.resize(size - tail.len(), b'a');
        body.extend_from_slice(tail.as_bytes());
        let mut request = format!(
            "POST /v1/messages HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
             x-request-id: {id}\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        .into_bytes();
        for piece in body.chunks(chunk) {
            request.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
            request.extend_from_slice(piece);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\n\r\n");
        let reply = raw_exchange(envoy.port, &request);
        assert_eq!(reply.status, 413, "{id}: {}", reply.body);
        let answer: serde_json::Value = serde_json::from_str(&reply.body)
            .unwrap_or_else(|_| panic!("{id}: not JSON: {}", reply.body));
        assert_eq!(answer["type"], "error", "{id}: {answer}");
        assert_eq!(
            answer["error"]["type"], "request_too_large",
            "{id}: {answer}"
        );
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|message| message.contains(&LIMIT.to_string())),
            "{id}: {answer}"
        );
        assert!(prefill.requests_with_id(&id).is_empty(), "{id}");
        assert!(decode.requests_with_id(&id).is_empty(), "{id}");
    }
}

/// A loopback TCP proxy to `port` that passes the client's bytes at once and the server's
/// only after `pause`: a client that stops reading its connection for that long. Its port.
async fn proxy_that_stops_reading(port: u16, pause: std::time::Duration) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let proxy_port = listener.local_addr().expect("address").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                continue;
            };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            });
            tokio::spawn(async move {
                tokio::time::sleep(pause).await;
                let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
            });
        }
    });
    proxy_port
}

/// envoy/envoy.yaml as shipped lets an HTTP/2 client stop reading for a while: its streams
/// wait under flow control and arrive whole. A token stream is one small frame per token,
/// and Envoy's default limit of 10,000 frames queued for a client closed the connection,
/// every stream on it, within a few seconds (Envoy's `http2.outbound_flood`).
#[test]
fn envoy_yaml_lets_an_http2_client_pause_its_reading_in_envoy() {
    use raw_http::{h2_connect_with_window, h2_exchange, H2Outcome, H2Request};
    const STREAMS: usize = 40;
    let (runtime, _prefill, _decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-pause");
    let outcomes = runtime.block_on(async {
        let port = proxy_that_stops_reading(envoy.port, std::time::Duration::from_secs(5)).await;
        let sender = h2_connect_with_window(port, 16 << 20).await.expect("h2c");
        let body = json!({"model": "mock-model", "max_tokens": 2000, "stream": true,
            "messages": [{"role": "user", "content": "a long answer"}]})
        .to_string();
        let exchanges = (0..STREAMS).map(|_| {
            let request = H2Request {
                method: "POST".into(),
                path: "/v1/chat/completions".into(),
                headers: vec![("content-type".into(), "application/json".into())],
                data: vec![body.as_bytes().to_vec()],
                trailers: vec![],
                reset_after: None,
            };
            h2_exchange(&sender, request, std::time::Duration::from_secs(90))
        });
        futures_util::future::join_all(exchanges).await
    });
    let stats =
        common::http_get(envoy.admin_port, "/stats?filter=http2.outbound").unwrap_or_default();
    for outcome in outcomes {
        let H2Outcome::Response(response) = outcome else {
            panic!("a stream was lost: {outcome:?}\n{stats}");
        };
        assert_eq!(response.status, 200);
        assert!(response.text().ends_with("data: [DONE]\n\n"));
    }
}

/// A decode stand-in that answers each request with an event stream of `total` bytes,
/// written as fast as the connection takes it. Its port, and the bytes it wrote on each
/// connection so far.
async fn long_stream_server(total: usize) -> (u16, std::sync::Arc<std::sync::Mutex<Vec<usize>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let counts = written.clone();
    tokio::spawn(async move {
        while let Ok((mut connection, _)) = listener.accept().await {
            let counts = counts.clone();
            tokio::spawn(async move {
                // The request: its head, then as many body bytes as it announces.
                let mut request = Vec::new();
                let mut buffer = [0u8; 65_536];
                let body_start = loop {
                    let Ok(read) = connection.read(&mut buffer).await else {
                        return;
                    };
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                    if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        break end + 4;
                    }
                };
                let head = String::from_utf8_lossy(&request[..body_start]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:"))
                    .and_then(|value| value.trim().parse().ok())
                    .unwrap_or(0);
                while request.len() < body_start + length {
                    match connection.read(&mut buffer).await {
                        Ok(read) if read > 0 => request.extend_from_slice(&buffer[..read]),
                        _ => return,
                    }
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\n\r\n";
                if connection.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let event = format!(
                    "data: {{\"choices\":[{{\"text\":\"{}\"}}]}}\n\n",
                    "x".repeat(200)
                );
                let chunk_body = event.repeat(65_536 / event.len());
                let chunk = format!("{:x}\r\n{chunk_body}\r\n", chunk_body.len());
                let slot = {
                    let mut counts = counts.lock().expect("counts");
                    counts.push(0);
                    counts.len() - 1
                };
                let mut sent = 0;
                while sent < total {
                    if connection.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                    sent += chunk_body.len();
                    counts.lock().expect("counts")[slot] = sent;
                }
                let _ = connection.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    (port, written)
}

/// The bytes Envoy's heap has allocated, read from its admin endpoint when asked (the
/// `server.memory_allocated` stat waits for the next stats flush).
fn heap_allocated(admin_port: u16) -> u64 {
    common::http_get(admin_port, "/memory")
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
        .and_then(|memory| memory["allocated"].as_str()?.parse().ok())
        .expect("allocated, from /memory")
}

/// envoy/envoy.yaml as shipped holds little for clients that stop reading a long answer:
/// Envoy stops reading decode once a client's connection holds the listener's buffer
/// (1 MiB). At 16 MiB, 180 HTTP/1.1 clients that paused their reading of long streams took
/// Envoy to 3 GB, past its heap limit, which resets no HTTP/1.1 stream.
#[test]
fn envoy_yaml_holds_little_for_clients_that_stop_reading_in_envoy() {
    const CLIENTS: usize = 8;
    let runtime = mock_runtime();
    let prefill = start_mock(&runtime, mock_vllm::Role::Prefill);
    let (decode_port, written) = runtime.block_on(long_stream_server(256 << 20));
    let envoy = start_shipped_envoy("envoy/envoy.yaml", "run-envoy-yaml-slow-readers", |text| {
        let text = substitute(
            &text,
            "port_value: 8100 }",
            &format!("port_value: {} }}", prefill.port()),
        );
        substitute(
            &text,
            "port_value: 8200 }",
            &format!("port_value: {decode_port} }}"),
        )
    });
    let allocated = || heap_allocated(envoy.admin_port);
    let before = allocated();
    let body = json!({"model": "mock-model", "prompt": "a long answer", "max_tokens": 100_000,
        "stream": true})
    .to_string();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| open_post(envoy.port, "/v1/completions", &[], &body))
        .collect();
    // Until every stream has met its client's flow control.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut last = Vec::new();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(2));
        let now = written.lock().expect("counts").clone();
        if now.len() == CLIENTS && now == last {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "decode's streams did not settle: {now:?}\n{}",
            envoy.log()
        );
        last = now;
    }
    let held = allocated().saturating_sub(before);
    drop(clients);
    assert!(
        last.iter().all(|&sent| sent < 256 << 20),
        "a stream went through whole, unread: {last:?}"
    );
    assert!(
        held < CLIENTS as u64 * (4 << 20),
        "Envoy holds {held} bytes more for {CLIENTS} clients that stopped reading (decode \
         wrote {last:?})"
    );
}

/// envoy/envoy.yaml as shipped: a body uploaded in small writes takes about its own size in
/// Envoy. Envoy keeps each read's 16 KiB slice for a piece of 512 bytes or more; without the
/// filter writing the held body again in one piece, each of these clients held about 16 MiB
/// for its 1 MiB (50 such clients took Envoy past its heap threshold, where it answers
/// everyone 503). The bodies then reach decode as sent.
#[test]
fn envoy_yaml_holds_a_body_uploaded_in_small_pieces_at_about_its_size_in_envoy() {
    use std::io::{Read, Write};
    const CLIENTS: usize = 4;
    const PIECE: usize = 1024;
    let (_runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-small-pieces");
    let allocated = || heap_allocated(envoy.admin_port);
    let words = "lorem ipsum dolor sit amet ".repeat(40_000);
    let bodies: Vec<String> = (0..CLIENTS)
        .map(|client| {
            json!({"model": "mock-model", "prompt": format!("{client} {words}"), "max_tokens": 4})
                .to_string()
        })
        .collect();
    let before = allocated();
    let mut streams: Vec<_> = bodies
        .iter()
        .enumerate()
        .map(|(client, body)| {
            let mut stream =
                std::net::TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
            stream.set_nodelay(true).expect("nodelay");
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n\
                 content-type: application/json\r\nx-request-id: small-pieces-{client}\r\n\
                 content-length: {}\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).expect("send head");
            stream
        })
        .collect();
    // All but the last 64 KiB of each body, a piece from each client in turn, so that Envoy
    // reads every piece on its own.
    let held_back = 64 * 1024;
    let mut sent = 0;
    while sent + held_back < bodies[0].len() {
        let end = (sent + PIECE).min(bodies[0].len() - held_back);
        for (stream, body) in streams.iter_mut().zip(&bodies) {
            stream
                .write_all(&body.as_bytes()[sent..end])
                .expect("send a piece");
        }
        sent = end;
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let held = allocated().saturating_sub(before);
    assert!(
        held < (CLIENTS * sent * 5) as u64,
        "Envoy holds {held} bytes more for {CLIENTS} uploads of {sent} bytes each"
    );
    for ((client, stream), body) in streams.iter_mut().enumerate().zip(&bodies) {
        stream
            .write_all(&body.as_bytes()[sent..])
            .expect("send the rest");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .expect("timeout");
        let mut answer = Vec::new();
        let mut buffer = [0u8; 65536];
        while !answer.windows(4).any(|window| window == b"\r\n\r\n") {
            let read = stream.read(&mut buffer).expect("read the answer");
            assert!(read > 0, "the connection closed without an answer");
            answer.extend_from_slice(&buffer[..read]);
        }
        let head = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "client {client}: {head}");
        assert!(
            head.contains("x-mock-kv: reused"),
            "client {client}: {head}"
        );
        let id = format!("small-pieces-{client}");
        let got = decode.requests_with_id(&id);
        assert_eq!(got.len(), 1, "decode requests for {id}");
        let mut decoded: Value = serde_json::from_slice(&got[0].body).expect("decode's body");
        decoded
            .as_object_mut()
            .expect("an object")
            .remove("kv_transfer_params");
        let sent: Value = serde_json::from_str(body).expect("the client's body");
        assert_eq!(decoded, sent, "client {client}'s body, as decode got it");
    }
}

/// envoy/envoy.yaml as shipped, with its heap limit lowered to 300 MB: HTTP/2 clients that
/// open hundreds of uploads and never finish them do not grow Envoy past it, because the
/// streams that buffer the most are reset near the limit.
#[test]
fn envoy_yaml_resets_open_uploads_near_its_heap_limit_in_envoy() {
    use bytes::Bytes;
    use raw_http::h2_connect;
    let envoy = start_shipped_envoy("envoy/envoy.yaml", "run-envoy-yaml-heap", |text| {
        substitute(
            &text,
            "max_heap_size_bytes: 2147483648",
            "max_heap_size_bytes: 314572800",
        )
    });
    let rss_mib = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|status| {
                let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map(|kib| kib / 1024)
    };
    let pid = envoy.child.id();
    let runtime = mock_runtime();
    let chunk = Bytes::from(vec![b'x'; 1 << 20]);
    let mut streams = Vec::new();
    runtime.block_on(async {
        for _ in 0..4 {
            let mut sender = h2_connect(envoy.port).await.expect("h2c");
            for _ in 0..100 {
                sender = sender.ready().await.expect("ready");
                let request = http::Request::post("http://localhost/v1/completions")
                    .header("content-type", "application/json")
                    .body(())
                    .expect("request");
                let (response, mut stream) =
                    sender.send_request(request, false).expect("send_request");
                // 15 MiB queued, sent as the windows allow; never the end of the body.
                for _ in 0..15 {
                    let _ = stream.send_data(chunk.clone(), false);
                }
                streams.push((response, stream));
            }
        }
    });
    let mut largest = 0;
    for _ in 0..24 {
        std::thread::sleep(std::time::Duration::from_millis(500));
        largest = largest.max(rss_mib(pid).expect("envoy is running"));
    }
    drop(streams);
    let stats = common::http_get(envoy.admin_port, "/stats?filter=reset_high_memory_stream")
        .unwrap_or_default();
    eprintln!("largest RSS {largest} MiB; {}", stats.replace('\n', "; "));
    assert!(
        largest < 700,
        "Envoy grew to {largest} MiB under a 300 MB heap limit; {stats}"
    );
    assert!(
        !stats.contains("reset_high_memory_stream.count: 0"),
        "no stream was reset: {stats}"
    );
}

/// envoy/envoy.yaml as shipped: every spelling of an endpoint either reaches the filter as the
/// canonical path (and so is orchestrated) or is refused by Envoy, and clients' copies of the
/// worker-choosing headers reach neither worker.
#[test]
fn envoy_yaml_canonicalizes_paths_and_strips_scheduler_headers_in_envoy() {
    let (_runtime, prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml");
    let mut failures = Vec::new();

    // Each spelling of an endpoint, and whether it must be orchestrated: encoded slashes get
    // Envoy's own 400, with neither worker called; the other spellings of /v1/completions are
    // normalized, then orchestrated like the real path.
    let spellings = [
        ("/v1%2Fcompletions", false),
        ("/v1%2fcompletions", false),
        ("/v1/chat%2Fcompletions", false),
        ("/v1%5Ccompletions", false),
        ("/v1/completions#frag", false),
        // vLLM (Starlette) serves a path with a final newline as the path without it: the
        // filter refuses escaped control characters.
        ("/v1/completions%0A", false),
        ("/v1/chat/completions%0a?x=1", false),
        ("/v1/completions%0A/", false),
        ("/invocations%0A", false),
        ("/v1/completions", true),
        ("/v1/%63ompletions", true),
        ("/%76%31/completions", true),
        ("//v1/completions", true),
        ("/v1//completions", true),
        ("/v1/./completions", true),
        ("/v1/%2e/completions", true),
        ("/v1/x/../completions", true),
        ("/v1\\completions", true),
    ];
    for (n, (target, orchestrate)) in spellings.into_iter().enumerate() {
        let id = format!("spelling-{n}");
        let reply = raw_post(
            envoy.port,
            target,
            &[("x-request-id", &id)],
            COMPLETION_BODY,
        );
        let prefills = prefill.requests_with_id(&id);
        let decodes = decode.requests_with_id(&id);
        if !orchestrate {
            let reached = prefills.len() + decodes.len();
            if reply.status != 400 || reached != 0 {
                failures.push(format!(
                    "{target}: {} (want 400), {reached} upstream requests (want 0)",
                    reply.status
                ));
            }
            if let Err(what) = openai_error(&reply, 400) {
                failures.push(format!("{target}: {what}"));
            }
            let envoys_refusal = !target.contains("%0");
            if envoys_refusal && !reply.body.contains("the request path cannot be normalized") {
                failures.push(format!("{target}: {}", reply.body));
            }
            if reply.header("x-request-id") != Some(id.as_str()) {
                failures.push(format!("{target}: Envoy's answer without its request id"));
            }
            continue;
        }
        let orchestrated = reply.status == 200
            && prefills.len() == 1
            && decodes.len() == 1
            && decodes[0].path == "/v1/completions"
            && decodes[0].json()["kv_transfer_params"].is_object();
        if !orchestrated {
            failures.push(format!(
                "{target}: {} {:?}; prefill got {:?}, decode got {:?}",
                reply.status,
                reply.body,
                prefills.iter().map(|r| &r.path).collect::<Vec<_>>(),
                decodes
                    .iter()
                    .map(|r| (&r.path, r.json()["kv_transfer_params"].is_object()))
                    .collect::<Vec<_>>()
            ));
        }
    }

    // Worker-choosing headers from the client: gone before prefill and decode.
    let id = "client-scheduler-headers";
    let admin = format!("127.0.0.1:{}", envoy.admin_port);
    let reply = raw_post(
        envoy.port,
        "/v1/completions",
        &[
            ("x-request-id", id),
            ("x-prefiller-host-port", &admin),
            ("x-gateway-destination-endpoint", &admin),
            ("x-pd-model", "another-model"),
            ("x-pd-anything", "1"),
            ("x-data-parallel-rank", "3"),
            ("x-envoy-original-dst-host", &admin),
            // Their spellings with underscores, which a server reading `_` as `-` would take
            // for them: dropped too.
            ("x_prefiller_host_port", &admin),
            ("x_gateway_destination_endpoint", &admin),
            ("x_data_parallel_rank", "3"),
        ],
        COMPLETION_BODY,
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    for request in prefill
        .requests_with_id(id)
        .iter()
        .chain(&decode.requests_with_id(id))
    {
        for header in TRUSTED_HEADERS {
            let underscored = header.replace('-', "_");
            let value = request.header(header).or(request.header(&underscored));
            if let Some(value) = value {
                failures.push(format!(
                    "{:?} got the client's {header}: {value}",
                    request.role
                ));
            }
        }
    }

    // Envoy's own refusals come as OpenAI errors; the filter's errors as the filter wrote
    // them, not wrapped again.
    let envoys_own: [(&[u8], u16); 3] = [
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: two\r\n\r\n{}",
            400,
        ),
        (
            b"post /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
            400,
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\
              transfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            400,
        ),
    ];
    for (request, status) in envoys_own {
        let reply = raw_exchange(envoy.port, request);
        if let Err(what) = openai_error(&reply, status) {
            let line = String::from_utf8_lossy(request);
            failures.push(format!("{:?}: {what}", line.lines().next()));
        }
    }
    // An HTTP/1.0 client (no Host header, the connection closed after the answer) is served
    // through prefill like any other.
    let id = "http-1-0";
    let request = format!(
        "POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n\
         x-request-id: {id}\r\ncontent-length: {}\r\n\r\n{COMPLETION_BODY}",
        COMPLETION_BODY.len()
    );
    let reply = raw_exchange(envoy.port, request.as_bytes());
    let (prefills, decodes) = (prefill.requests_with_id(id), decode.requests_with_id(id));
    let orchestrated = prefills.len() == 1
        && decodes.len() == 1
        && decodes[0].json()["kv_transfer_params"].is_object();
    if reply.status != 200 || !orchestrated {
        failures.push(format!(
            "HTTP/1.0: {} {:?}, {} prefill and {} decode requests",
            reply.status,
            reply.body,
            prefills.len(),
            decodes.len()
        ));
    }
    let reply = raw_post(envoy.port, "/v1/completions", &[], r#"{"prompt":"#);
    match openai_error(&reply, 400) {
        Ok(error) if error["type"] == "BadRequestError" && error["message"].is_string() => {}
        other => failures.push(format!("the filter's own 400: {other:?}: {}", reply.body)),
    }

    // The stats as shipped: labelled on /stats/prometheus.
    let prometheus =
        common::http_get(envoy.admin_port, "/stats/prometheus").expect("/stats/prometheus");
    let served = "pd_filter_requests{api=\"completions\",outcome=\"decoded\"} ";
    let count = prometheus
        .lines()
        .find_map(|line| line.strip_prefix(served)?.trim().parse::<u64>().ok());
    if count.is_none_or(|count| count == 0) {
        failures.push(format!("no {served}on /stats/prometheus:\n{prometheus}"));
    }
    assert!(failures.is_empty(), "{failures:#?}\n{}", envoy.log());
}

/// envoy/examples/scheduler.yaml as shipped, with a stand-in for the endpoint picker (a header
/// mutation filter before the wasm filter that copies `x-test-picker` into
/// `x-gateway-destination-endpoint`): the picker chooses among the decode pool's endpoints,
/// an address outside the pool (Envoy's admin) falls back to the pool, and a client's own
/// `x-gateway-destination-endpoint` or `x-prefiller-host-port` never takes effect.
#[test]
fn scheduler_example_keeps_decode_choices_within_the_pool_in_envoy() {
    use mock_vllm::Role;
    let runtime = mock_runtime();
    let prefill = start_mock(&runtime, Role::Prefill);
    let decode_a = start_mock(&runtime, Role::Decode);
    let decode_b = start_mock(&runtime, Role::Decode);
    let endpoint = |port: u16| {
        format!("- endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }} }}")
    };
    let envoy = start_shipped_envoy("envoy/examples/scheduler.yaml", "run-scheduler", |text| {
        let text = substitute(
            &text,
            "address: vllm-prefill.internal, port_value: 8000",
            &format!("address: 127.0.0.1, port_value: {}", prefill.port()),
        );
        let decode_line = "- endpoint: { address: { socket_address: { address: vllm-decode.internal, port_value: 8000 } } }";
        let indent = " ".repeat(14);
        let text = substitute(
            &text,
            decode_line,
            &format!(
                "{}\n{indent}{}",
                endpoint(decode_a.port()),
                endpoint(decode_b.port())
            ),
        );
        let picker = r#"                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations:
                        request_mutations:
                          - append:
                              header: { key: x-gateway-destination-endpoint, value: "%REQ(x-test-picker)%" }
                              append_action: OVERWRITE_IF_EXISTS_OR_ADD
"#;
        let wasm = "                  - name: envoy.filters.http.wasm\n";
        substitute(&text, wasm, &format!("{picker}{wasm}"))
    });
    let admin = format!("127.0.0.1:{}", envoy.admin_port);
    let a = format!("127.0.0.1:{}", decode_a.port());
    let b = format!("127.0.0.1:{}", decode_b.port());
    // Which decode served `id` ("a", "b", or what went wrong).
    let served_by = |id: &str, reply: &Reply| -> String {
        let (in_a, in_b) = (
            decode_a.requests_with_id(id).len(),
            decode_b.requests_with_id(id).len(),
        );
        match (reply.status, in_a, in_b) {
            (200, 1, 0) => "a".to_owned(),
            (200, 0, 1) => "b".to_owned(),
            _ => {
                let excerpt: String = reply.body.chars().take(120).collect();
                format!("status {} ({excerpt:?}), a {in_a}, b {in_b}", reply.status)
            }
        }
    };
    let mut failures = Vec::new();
    let mut check = |what: &str, headers: &[(&str, &str)], want: &[&str]| {
        for attempt in 0..3 {
            let id = format!("{what}-{attempt}");
            let mut all = vec![("x-request-id", id.as_str())];
            all.extend_from_slice(headers);
            let reply = raw_post(envoy.port, "/v1/completions", &all, COMPLETION_BODY);
            let got = served_by(&id, &reply);
            if !want.contains(&got.as_str()) {
                failures.push(format!("{what}: served by {got}, want one of {want:?}"));
            }
        }
    };
    check("picker-a", &[("x-test-picker", &a)], &["a"]);
    check("picker-b", &[("x-test-picker", &b)], &["b"]);
    check("picker-admin", &[("x-test-picker", &admin)], &["a", "b"]);
    check(
        "client-admin",
        &[("x-gateway-destination-endpoint", &admin)],
        &["a", "b"],
    );
    check(
        "client-prefill-admin",
        &[("x-prefiller-host-port", &admin)],
        &["a", "b"],
    );
    // The client's prefill host never took effect: every prefill went to the pool.
    let pooled_prefills = (0..3)
        .map(|attempt| {
            prefill
                .requests_with_id(&format!("client-prefill-admin-{attempt}"))
                .len()
        })
        .sum::<usize>();
    if pooled_prefills != 3 {
        failures.push(format!(
            "client x-prefiller-host-port: {pooled_prefills} of 3 prefills reached the pool"
        ));
    }
    assert!(failures.is_empty(), "{failures:#?}\n{}", envoy.log());
}

/// Reads one answer with a content-length from `stream`: its head (lowercased) and body.
fn read_sized_answer(stream: &mut std::net::TcpStream) -> (String, String) {
    use std::io::Read;
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        let read = stream.read(&mut byte).expect("read the answer's head");
        assert!(read == 1, "connection closed within a head: {raw:?}");
        raw.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    let length = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no content-length in {head:?}"));
    let mut body = vec![0u8; length];
    stream
        .read_exact(&mut body)
        .expect("read the answer's body");
    (head, String::from_utf8_lossy(&body).into_owned())
}

/// envoy/envoy.yaml as shipped keeps an HTTP/1.1 connection open after a 400 the filter
/// answers, or prefill's that it passes on, as vLLM does, so that the client's next request
/// goes on the same connection; malformed HTTP still closes it.
/// An HTTP/2 request Envoy's codec refuses (a tab in its `:path`) resets its own stream, not
/// the connection: the client's other streams on it, a P/D request among them, go on (Envoy
/// otherwise ends the whole connection, and with it every stream a multiplexing client or a
/// load balancer in front has on it).
#[test]
fn envoy_yaml_resets_only_a_malformed_http2_stream_in_envoy() {
    use std::io::{Read, Write};
    let (_runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-h2-reset");
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(stream.to_be_bytes());
        out.extend_from_slice(payload);
        out
    };
    // HPACK literals without indexing, new names (every length here is below 127).
    let header_block = |headers: &[(&str, &str)]| {
        let mut out = Vec::new();
        for (name, value) in headers {
            out.push(0);
            out.push(name.len() as u8);
            out.extend_from_slice(name.as_bytes());
            out.push(value.len() as u8);
            out.extend_from_slice(value.as_bytes());
        }
        out
    };
    let request = |path: &str, length: usize| {
        header_block(&[
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "localhost"),
            (":path", path),
            ("content-type", "application/json"),
            ("content-length", &length.to_string()),
        ])
    };
    const HEADERS: u8 = 1;
    const DATA: u8 = 0;
    const END_STREAM: u8 = 1;
    const END_HEADERS: u8 = 4;
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(4, 0, 0, &[]));
    out.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &request("/v1/comp\tletions", 2),
    ));
    out.extend(frame(DATA, END_STREAM, 1, b"{}"));
    out.extend(frame(
        HEADERS,
        END_HEADERS,
        3,
        &request("/v1/completions", COMPLETION_BODY.len()),
    ));
    out.extend(frame(DATA, END_STREAM, 3, COMPLETION_BODY.as_bytes()));
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    stream.write_all(&out).expect("send");
    let (mut reset_first, mut answered_second) = (false, false);
    let mut head = [0u8; 9];
    while !(reset_first && answered_second) {
        if stream.read_exact(&mut head).is_err() {
            panic!("the connection ended: first stream reset {reset_first}, second answered {answered_second}");
        }
        let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; length];
        stream.read_exact(&mut payload).expect("a frame's payload");
        match (kind, id) {
            (4, 0) if flags & 1 == 0 => stream.write_all(&frame(4, 1, 0, &[])).expect("ack"),
            (7, _) => panic!("GOAWAY: {payload:?}"),
            (3, 1) => reset_first = true,
            (HEADERS, 3) => answered_second = true,
            (HEADERS, 1) => panic!("the malformed stream was answered"),
            _ => {}
        }
    }
    let served = decode.requests();
    assert!(
        served.iter().any(|r| r.path == "/v1/completions"),
        "{served:?}"
    );
}

#[test]
fn envoy_yaml_keeps_a_connection_after_a_refused_request_in_envoy() {
    use std::io::{Read, Write};
    let (_runtime, _prefill, decode, envoy) = envoy_yaml_before_mocks("run-envoy-yaml-reuse");
    let refusals = [
        ("bad JSON", "{bad".to_owned()),
        (
            "min_tokens above max_tokens",
            json!({"model": "mock-model", "prompt": "x", "max_tokens": 2, "min_tokens": 5})
                .to_string(),
        ),
        (
            "prefill's 400",
            json!({"model": "mock-model", "prompt": "no mock:prefill_status=400", "max_tokens": 2})
                .to_string(),
        ),
    ];
    for (label, body) in refusals {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .expect("timeout");
        let refused = post_request("/v1/completions", &[], &body);
        stream.write_all(refused.as_bytes()).expect("send");
        let (head, answer) = read_sized_answer(&mut stream);
        assert!(head.starts_with("http/1.1 400 "), "{label}: {head}{answer}");
        assert!(!head.contains("connection: close"), "{label}: {head}");
        let served = post_request("/v1/completions", &[], COMPLETION_BODY);
        stream
            .write_all(served.as_bytes())
            .expect("send the next request");
        let (head, answer) = read_sized_answer(&mut stream);
        assert!(
            head.starts_with("http/1.1 200 "),
            "{label}, then a request on the same connection: {head}{answer}"
        );
    }
    let before = decode.requests().len();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("timeout");
    let smuggled = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{}",
        post_request("/v1/completions", &[], COMPLETION_BODY)
    );
    stream.write_all(smuggled.as_bytes()).expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read until closed");
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 400 "), "{raw}");
    assert_eq!(raw.matches("HTTP/1.1 ").count(), 1, "{raw}");
    assert_eq!(decode.requests().len(), before, "{:?}", decode.requests());
}

/// Every Envoy configuration sends the filter's KV releases to clusters of their own, not the
/// ones the routes send clients to, and gives decode's pools circuit breakers above Envoy's
/// default of 1,024: clients that stop reading long answers hold decode's requests until
/// stream_idle_timeout, and at the default a couple of thousand such streams made every other
/// request 503 and every KV release fail (review of the deployment files).
#[test]
fn kv_releases_have_a_pool_of_their_own_and_the_workers_pools_are_raised() {
    for path in envoy_configs() {
        let relative = path
            .strip_prefix(repo_root())
            .expect("under the repository")
            .to_string_lossy()
            .into_owned();
        let config = yaml_file(&relative).remove(0);
        let clusters = config["static_resources"]["clusters"]
            .as_array()
            .expect("clusters");
        let mut routed = Vec::new();
        for (_, hcm) in http_connection_managers(&config) {
            for host in hcm["route_config"]["virtual_hosts"]
                .as_array()
                .into_iter()
                .flatten()
            {
                for route in host["routes"].as_array().into_iter().flatten() {
                    if let Some(cluster) = route["route"]["cluster"].as_str() {
                        routed.push(cluster.to_owned());
                    }
                }
            }
            for (_, plugin) in wasm_filters(hcm) {
                let release = plugin["decode_cluster"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{relative}: no decode_cluster"));
                let per_model = plugin["model_decode_clusters"]
                    .as_object()
                    .into_iter()
                    .flat_map(|map| map.values().filter_map(|v| v.as_str()));
                for release in std::iter::once(release).chain(per_model) {
                    assert!(
                        !routed.iter().any(|c| c == release),
                        "{relative}: KV releases share the routed cluster {release:?}"
                    );
                    assert!(
                        clusters.iter().any(|c| c["name"] == release),
                        "{relative}: no cluster {release:?}"
                    );
                }
            }
        }
        // The prefill pools: a full one makes Envoy refuse the filter's call at once (503).
        let prefill = clusters
            .iter()
            .filter_map(|c| c["name"].as_str())
            .filter(|name| name.starts_with("prefill"))
            .map(str::to_owned);
        for name in routed.into_iter().chain(prefill) {
            let cluster = clusters
                .iter()
                .find(|c| c["name"] == name.as_str())
                .unwrap_or_else(|| panic!("{relative}: no cluster {name}"));
            let thresholds = &cluster["circuit_breakers"]["thresholds"][0];
            for key in ["max_requests", "max_pending_requests", "max_connections"] {
                assert!(
                    thresholds[key].as_u64().is_some_and(|n| n >= 4096),
                    "{relative}: cluster {name}: {key} at Envoy's default (1,024) or below 4,096"
                );
            }
        }
    }
}
