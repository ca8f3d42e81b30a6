//! The deployment files: the Istio manifests against Istio's `WasmPlugin` CRD schema and the
//! filter's own configuration parser, every Envoy configuration through `envoy --mode validate`
//! with the built filter, and the docker-compose stack's references.

mod common;

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
// (a) The WasmPlugin against Istio's CRD.

/// Istio's WasmPlugin CRD, from the shared folder that sits beside the repository.
fn wasm_plugin_crd() -> Value {
    let path = repo_root().join("../shared/schemas/istio-wasmplugin-crd.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the shared/ folder must sit beside the repository)",
            path.display()
        )
    });
    let mut documents = yaml_documents(&text, "istio-wasmplugin-crd.yaml");
    assert_eq!(documents.len(), 1);
    documents.remove(0)
}

/// The CRD's `v1alpha1` schema as a JSON schema that a manifest must pass to be applied with
/// every field intact.
///
/// Kubernetes validates the object against `openAPIV3Schema` and silently drops (prunes) fields
/// the schema does not declare, unless `x-kubernetes-preserve-unknown-fields` is set: a
/// misspelt `failStratgy` would be dropped and the plugin would run with the default. Here an
/// undeclared field is an error instead. The schema leaves out `apiVersion`, `kind` and
/// `metadata`, which Kubernetes checks itself; they are added here.
fn strict_manifest_schema(crd: &Value) -> (Value, String, String) {
    let group = crd["spec"]["group"].as_str().expect("CRD group");
    let kind = crd["spec"]["names"]["kind"].as_str().expect("CRD kind");
    let version = crd["spec"]["versions"]
        .as_array()
        .expect("CRD versions")
        .iter()
        .find(|version| version["name"] == "v1alpha1")
        .expect("CRD version v1alpha1");
    let mut schema = version["schema"]["openAPIV3Schema"].clone();
    assert!(schema.is_object(), "CRD without openAPIV3Schema");
    let api_version = format!("{group}/v1alpha1");
    let properties = schema["properties"]
        .as_object_mut()
        .expect("schema properties");
    properties.insert("apiVersion".into(), json!({ "enum": [api_version] }));
    properties.insert("kind".into(), json!({ "enum": [kind] }));
    properties.insert(
        "metadata".into(),
        json!({
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": { "type": "string", "minLength": 1 },
                "namespace": { "type": "string", "minLength": 1 },
                "labels": { "type": "object" },
                "annotations": { "type": "object" }
            }
        }),
    );
    forbid_unknown_fields(&mut schema);
    (schema, api_version, kind.to_owned())
}

fn forbid_unknown_fields(schema: &mut Value) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let preserves = object.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true));
    if object.contains_key("properties") && !preserves {
        object
            .entry("additionalProperties")
            .or_insert(Value::Bool(false));
    }
    for (key, child) in object.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let Some(properties) = child.as_object_mut() {
                    properties.values_mut().for_each(forbid_unknown_fields);
                }
            }
            "items" | "additionalProperties" => forbid_unknown_fields(child),
            "anyOf" | "allOf" | "oneOf" => {
                if let Some(schemas) = child.as_array_mut() {
                    schemas.iter_mut().for_each(forbid_unknown_fields);
                }
            }
            _ => {}
        }
    }
}

/// What is wrong with `manifest` as a WasmPlugin: the schema's errors, and the CRD's CEL rules
/// that matter here (a JSON-schema validator does not run CEL).
fn wasm_plugin_errors(manifest: &Value) -> Vec<String> {
    let (schema, _, _) = strict_manifest_schema(&wasm_plugin_crd());
    let validator = jsonschema::draft4::new(&schema).expect("the CRD schema compiles");
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
    errors
}

#[test]
fn wasm_plugin_passes_the_istio_crd_schema() {
    let manifest = wasm_plugin();
    let errors = wasm_plugin_errors(&manifest);
    assert!(errors.is_empty(), "WasmPlugin rejected: {errors:#?}");

    let (_, api_version, kind) = strict_manifest_schema(&wasm_plugin_crd());
    assert_eq!(manifest["apiVersion"], api_version.as_str());
    assert_eq!(manifest["kind"], kind.as_str());
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
        spec["failStrategy"], "FAIL_CLOSE",
        "fail closed: no request may reach decode without its prefill"
    );
    assert_eq!(
        spec["phase"], "STATS",
        "after Istio's authn and authz filters"
    );
    assert_eq!(spec["type"], "HTTP");
    assert!(spec["imagePullPolicy"].is_string());
    assert!(spec["selector"]["matchLabels"].is_object());
}

/// What is broken, an excerpt of the error it must cause, and how to break a manifest so.
type Breakage = (&'static str, &'static str, fn(&mut Value));

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
    ];
    for (what, expected, breakage) in breakages {
        let mut manifest = valid.clone();
        breakage(&mut manifest);
        let errors = wasm_plugin_errors(&manifest);
        assert!(
            errors.iter().any(|error| error.contains(expected)),
            "a WasmPlugin with {what}: expected an error with {expected:?}, got {errors:?}"
        );
    }
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
    let routes = virtual_service["spec"]["http"].as_array().expect("http");
    assert!(!routes.is_empty());
    for route in routes {
        assert_eq!(route["timeout"], "0s", "long generations: {route}");
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

/// `ADDR:PORT` → PORT.
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

/// Validation really loads the filter: a configuration the filter rejects fails it.
#[test]
fn envoy_validate_runs_the_filters_configuration() {
    let wasm = wasm_path();
    let dir = scratch_dir("validate-bad");
    let text = read("envoy/envoy.yaml");
    let broken = text.replace("\"prefill_timeout_ms\"", "\"prefill_timeout\"");
    assert_ne!(broken, text, "envoy.yaml sets prefill_timeout_ms");
    let target = dir.join("envoy-bad-plugin-config.yaml");
    std::fs::write(&target, localize(&broken, &wasm, &dir)).expect("write config");
    let output = envoy_validate(&target).expect_err("an unknown plugin key must fail validation");
    assert!(output.contains("pd-filter"), "{output}");
}
