//! Cluster specs: unit parsing, the shipped specs, link lookup and error locations.

use hzp_ir::Mesh;
use hzp_passes::cost::cluster::{
    parse_bytes, parse_duration, parse_flops, parse_rate, ClusterSpec,
};
use std::path::PathBuf;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

fn clusters_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/clusters")
}

const GOOD: &str = r#"
name = "test"
mesh = "node=2,gpu=8"
devices_per_node = 8

[device]
memory = "80GiB"
peak_bf16 = "989TFLOPS"
peak_fp32 = "67TFLOPS"
memory_bandwidth = "3.35TB/s"

[[links]]
name = "nvlink"
axes = ["gpu"]
bandwidth = "450GB/s"
latency = "3us"

[[links]]
name = "ib"
axes = ["node"]
bandwidth = "400Gb/s"
latency = "10us"
"#;

/// 1-based line of the first line of `src` containing `needle`.
fn line_of(src: &str, needle: &str) -> usize {
    src.lines()
        .position(|l| l.contains(needle))
        .expect("needle in source")
        + 1
}

#[test]
fn parses_byte_sizes() {
    assert_eq!(parse_bytes("80GiB").unwrap(), 80 * (1u64 << 30));
    assert_eq!(parse_bytes("64GB").unwrap(), 64_000_000_000);
    assert_eq!(parse_bytes("512").unwrap(), 512);
    assert_eq!(parse_bytes("1.5KiB").unwrap(), 1536);
    assert_eq!(parse_bytes("2 MiB").unwrap(), 2 << 20);
    assert_eq!(parse_bytes("8Gb").unwrap(), 1_000_000_000);
    assert_eq!(parse_bytes("1_000B").unwrap(), 1000);
    for bad in ["80XB", "GiB", "-1GB", "", "80 GiBs", "1e400B"] {
        assert!(parse_bytes(bad).is_err(), "{bad} should be rejected");
    }
    assert!(parse_bytes("80XB").unwrap_err().contains("XB"));
}

#[test]
fn parses_rates() {
    assert_eq!(parse_rate("400Gb/s").unwrap(), 50e9);
    assert_eq!(parse_rate("450GB/s").unwrap(), 450e9);
    assert!(close(parse_rate("3.35TB/s").unwrap(), 3.35e12));
    assert_eq!(parse_rate("25GBps").unwrap(), 25e9);
    assert_eq!(parse_rate("100Gbps").unwrap(), 12.5e9);
    assert_eq!(parse_rate("1GiB/s").unwrap(), (1u64 << 30) as f64);
    assert_eq!(parse_rate("1e9").unwrap(), 1e9);
    for bad in ["450GB", "5XB/s", "fast", "GB/s"] {
        assert!(parse_rate(bad).is_err(), "{bad} should be rejected");
    }
}

#[test]
fn parses_flops_and_durations() {
    assert_eq!(parse_flops("989TFLOPS").unwrap(), 989e12);
    assert_eq!(parse_flops("19.5 TFLOP/s").unwrap(), 19.5e12);
    assert!(close(parse_flops("1.2PFLOPS").unwrap(), 1.2e15));
    assert_eq!(parse_flops("67e12").unwrap(), 67e12);
    assert_eq!(parse_flops("1EFLOPS").unwrap(), 1e18);
    assert!(parse_flops("10TB/s").is_err());
    assert!(parse_flops("10XFLOPS").is_err());

    assert!(close(parse_duration("3us").unwrap(), 3e-6));
    assert!(close(parse_duration("3µs").unwrap(), 3e-6));
    assert!(close(parse_duration("1.5ms").unwrap(), 1.5e-3));
    assert!(close(parse_duration("200ns").unwrap(), 200e-9));
    assert_eq!(parse_duration("2s").unwrap(), 2.0);
    assert_eq!(parse_duration("0.5").unwrap(), 0.5);
    assert!(parse_duration("3 fortnights").is_err());
}

#[test]
fn loads_the_shipped_specs() {
    let h100 = ClusterSpec::load(clusters_dir().join("h100-dgx.toml")).unwrap();
    assert_eq!(h100.name, "h100-dgx");
    assert_eq!(h100.device.memory_bytes, 80 << 30);
    assert_eq!(h100.device.peak_flops_bf16, 989e12);
    assert_eq!(h100.device.peak_flops_fp32, 67e12);
    assert!(close(h100.device.memory_bandwidth, 3.35e12));
    assert_eq!(h100.mesh.world_size(), 1024);
    assert_eq!(h100.devices_per_node, 8);
    assert_eq!(h100.nodes(&h100.mesh), 128);
    let nv = h100.link_for_axis("gpu").unwrap();
    assert_eq!(
        (nv.name.as_str(), nv.bandwidth, nv.latency),
        ("nvlink", 450e9, 3e-6)
    );
    let ib = h100.link_for_axis("node").unwrap();
    assert_eq!((ib.name.as_str(), ib.bandwidth), ("ib", 50e9));
    assert!(close(ib.latency, 10e-6));

    let a100 = ClusterSpec::load(clusters_dir().join("a100-dgx.toml")).unwrap();
    assert_eq!(a100.device.peak_flops_bf16, 312e12);
    assert_eq!(a100.device.peak_flops_fp32, 19.5e12);
    assert_eq!(a100.link_for_axis("gpu").unwrap().bandwidth, 300e9);
    assert_eq!(a100.link_for_axis("node").unwrap().bandwidth, 25e9);

    let paper = ClusterSpec::load(clusters_dir().join("asynchzp-paper.toml")).unwrap();
    assert_eq!(paper.devices_per_node, 16);
    assert_eq!(paper.device.memory_bytes, 64 << 30);
    assert_eq!(paper.device.peak_flops_bf16, 300e12);
    let names: Vec<&str> = paper.mesh.axes.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["node", "group", "card"]);
    assert_eq!(paper.link_for_axis("card").unwrap().bandwidth, 400e9);
    assert_eq!(paper.link_for_axis("node").unwrap().bandwidth, 25e9);
    assert_eq!(paper.link_for_axis("group").unwrap().name, "intra-node");
    // A node is the product of the axes inside it.
    assert_eq!(paper.nodes(&paper.mesh), 64);
}

#[test]
fn defaults_apply_when_keys_are_absent() {
    let s = ClusterSpec::from_toml_str(GOOD, "good.toml").unwrap();
    assert_eq!(s.device.matmul_efficiency, 0.6);
    assert_eq!(s.device.memory_efficiency, 0.8);
    assert_eq!(s.device.launch_overhead, 0.0);
    assert_eq!(s.device.peak_flops_fp16, None);
    assert_eq!(s.links[0].efficiency, 1.0);
    assert_eq!(s.links[0].effective_bandwidth(), 450e9);
}

#[test]
fn round_trips_through_toml() {
    for f in ["h100-dgx.toml", "a100-dgx.toml", "asynchzp-paper.toml"] {
        let s = ClusterSpec::load(clusters_dir().join(f)).unwrap();
        let text = s.to_toml_string().unwrap();
        let back = ClusterSpec::from_toml_str(&text, "roundtrip.toml").unwrap();
        assert_eq!(back, s, "{f}");
    }
}

#[test]
fn split_axes_inherit_their_link_and_exact_bindings_win() {
    let s = ClusterSpec::from_toml_str(GOOD, "good.toml").unwrap();
    let mesh = Mesh::parse("node=2,gpu=2x4").unwrap();
    s.validate_mesh(&mesh).unwrap();
    assert_eq!(s.link_for_axis("gpu.0").unwrap().name, "nvlink");
    assert_eq!(s.link_for_axis("gpu.1").unwrap().name, "nvlink");
    assert!(s.link_for_axis("gpux").is_err());
    assert!(s.link_for_axis("gpu.x").is_err());

    let src = GOOD.replace(
        "[[links]]\nname = \"ib\"",
        "[[links]]\nname = \"pcie\"\naxes = [\"gpu.0\"]\nbandwidth = \"64GB/s\"\nlatency = \"5us\"\n\n[[links]]\nname = \"ib\"",
    );
    let s = ClusterSpec::from_toml_str(&src, "split.toml").unwrap();
    assert_eq!(s.link_for_axis("gpu.0").unwrap().name, "pcie");
    assert_eq!(s.link_for_axis("gpu.1").unwrap().name, "nvlink");
}

#[test]
fn a_mesh_axis_without_a_link_is_an_error() {
    let s = ClusterSpec::from_toml_str(GOOD, "good.toml").unwrap();
    let err = s
        .validate_mesh(&Mesh::parse("rack=2,node=2,gpu=8").unwrap())
        .unwrap_err();
    assert!(err.message.contains("`rack`"), "{err}");

    let src = GOOD.replace("mesh = \"node=2,gpu=8\"", "mesh = \"rack=2,node=2,gpu=8\"");
    let err = ClusterSpec::from_toml_str(&src, "norack.toml").unwrap_err();
    assert_eq!(err.file.as_deref(), Some("norack.toml"));
    assert_eq!(err.key.as_deref(), Some("mesh"));
    assert_eq!(err.line, Some(line_of(&src, "mesh =")));
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("norack.toml:{}", line_of(&src, "mesh ="))),
        "{text}"
    );
    assert!(text.contains("rack"), "{text}");
}

#[test]
fn unknown_keys_name_file_and_line() {
    let src = GOOD.replace(
        "peak_fp32 = \"67TFLOPS\"",
        "peak_fp32 = \"67TFLOPS\"\nmemroy = 5",
    );
    let err = ClusterSpec::from_toml_str(&src, "typo.toml").unwrap_err();
    assert_eq!(err.file.as_deref(), Some("typo.toml"));
    assert_eq!(err.line, Some(line_of(&src, "memroy")));
    assert_eq!(err.key.as_deref(), Some("device.memroy"));
    assert!(err.message.contains("memroy"), "{err}");
    assert!(err
        .to_string()
        .contains(&format!("typo.toml:{}", line_of(&src, "memroy"))));

    let src = format!("colour = \"red\"\n{GOOD}");
    let err = ClusterSpec::from_toml_str(&src, "top.toml").unwrap_err();
    assert_eq!(err.line, Some(1));
    assert!(err.message.contains("colour"), "{err}");
}

#[test]
fn bad_units_name_file_line_and_key() {
    let src = GOOD.replace("bandwidth = \"400Gb/s\"", "bandwidth = \"400Gx/s\"");
    let err = ClusterSpec::from_toml_str(&src, "unit.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "400Gx/s")));
    assert_eq!(err.key.as_deref(), Some("links[1].bandwidth"));
    assert!(err.message.contains("Gx"), "{err}");

    let src = GOOD.replace("memory = \"80GiB\"", "memory = \"80 gigs\"");
    let err = ClusterSpec::from_toml_str(&src, "unit.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "80 gigs")));
    assert_eq!(err.key.as_deref(), Some("device.memory"));

    let src = GOOD.replace("latency = \"3us\"", "latency = -3");
    let err = ClusterSpec::from_toml_str(&src, "neg.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "latency = -3")));

    let src = GOOD.replace("mesh = \"node=2,gpu=8\"", "mesh = \"node=2,gpu=zero\"");
    let err = ClusterSpec::from_toml_str(&src, "mesh.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "mesh =")));
    assert_eq!(err.key.as_deref(), Some("mesh"));
}

#[test]
fn invalid_values_name_the_key_and_line() {
    let src = GOOD.replace("bandwidth = \"450GB/s\"", "bandwidth = 0");
    let err = ClusterSpec::from_toml_str(&src, "zero.toml").unwrap_err();
    assert_eq!(err.key.as_deref(), Some("links[0].bandwidth"));
    assert_eq!(err.line, Some(line_of(&src, "bandwidth = 0")));

    let src = GOOD.replace(
        "peak_fp32 = \"67TFLOPS\"",
        "peak_fp32 = \"67TFLOPS\"\nmatmul_efficiency = 1.5",
    );
    let err = ClusterSpec::from_toml_str(&src, "eff.toml").unwrap_err();
    assert_eq!(err.key.as_deref(), Some("device.matmul_efficiency"));
    assert_eq!(err.line, Some(line_of(&src, "matmul_efficiency")));

    let src = GOOD.replace("axes = [\"node\"]", "axes = [\"gpu\"]");
    let err = ClusterSpec::from_toml_str(&src, "dup.toml").unwrap_err();
    assert_eq!(err.key.as_deref(), Some("links[1].axes"));
    assert!(
        err.message.contains("nvlink") && err.message.contains("ib"),
        "{err}"
    );

    let src = GOOD.replace("name = \"ib\"", "name = \"nvlink\"");
    let err = ClusterSpec::from_toml_str(&src, "dupname.toml").unwrap_err();
    assert_eq!(err.key.as_deref(), Some("links[1].name"));

    let src = GOOD.replace("devices_per_node = 8", "devices_per_node = 0");
    let err = ClusterSpec::from_toml_str(&src, "dpn.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "devices_per_node")));
}

#[test]
fn syntax_errors_and_missing_keys_are_reported() {
    let src = GOOD.replace("latency = \"10us\"", "latency = \"10us");
    let err = ClusterSpec::from_toml_str(&src, "syntax.toml").unwrap_err();
    assert_eq!(err.line, Some(line_of(&src, "latency = \"10us")));

    let src = GOOD.replace("peak_bf16 = \"989TFLOPS\"\n", "");
    let err = ClusterSpec::from_toml_str(&src, "missing.toml").unwrap_err();
    assert!(err.message.contains("peak_bf16"), "{err}");
    assert_eq!(err.file.as_deref(), Some("missing.toml"));

    let err = ClusterSpec::load(clusters_dir().join("does-not-exist.toml")).unwrap_err();
    assert!(err.to_string().contains("does-not-exist.toml"), "{err}");
}
