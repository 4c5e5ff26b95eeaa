//! Checkpoint write and load time and bytes for GPT-2 small shapes (124M parameters: vocab
//! 50257, 1024 positions, 12 layers of 768), sharded ZeRO-3 style over W ranks: each rank
//! keeps its 1/W of every parameter's fp32 master, AdamW's two moments and its compute
//! shard, plus the step counter, as `hzp run --checkpoint-dir` writes them.
//!
//! cargo run --release -p hzp-runtime --example checkpoint_bench [-- W DIR]

use hzp_ir::{DType, Group, Mesh, ParamLayout, Tensor};
use hzp_runtime::checkpoint::{self, Manifest};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let w: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let dir = std::path::PathBuf::from(args.get(2).cloned().unwrap_or_else(|| {
        std::env::temp_dir()
            .join("hzp-ckpt-bench")
            .display()
            .to_string()
    }));
    let _ = std::fs::remove_dir_all(&dir);
    let (v, t, d, l) = (50257usize, 1024usize, 768usize, 12usize);
    let mut shapes: Vec<(String, Vec<usize>)> =
        vec![("wte".into(), vec![v, d]), ("wpe".into(), vec![t, d])];
    for i in 0..l {
        for (n, s) in [
            ("ln_1.weight", vec![d]),
            ("ln_1.bias", vec![d]),
            ("attn.c_attn.weight", vec![d, 3 * d]),
            ("attn.c_attn.bias", vec![3 * d]),
            ("attn.c_proj.weight", vec![d, d]),
            ("attn.c_proj.bias", vec![d]),
            ("ln_2.weight", vec![d]),
            ("ln_2.bias", vec![d]),
            ("mlp.c_fc.weight", vec![d, 4 * d]),
            ("mlp.c_fc.bias", vec![4 * d]),
            ("mlp.c_proj.weight", vec![4 * d, d]),
            ("mlp.c_proj.bias", vec![d]),
        ] {
            shapes.push((format!("h.{i}.{n}"), s));
        }
    }
    shapes.push(("ln_f.weight".into(), vec![d]));
    shapes.push(("ln_f.bias".into(), vec![d]));
    let mesh = Mesh::parse(&format!("gpu={w}")).unwrap();
    let g = Group::new(["gpu"]);
    let mut layouts = Vec::new();
    let mut per_rank: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); w];
    let mut numel_total = 0;
    for (name, shape) in &shapes {
        let numel: usize = shape.iter().product();
        numel_total += numel;
        let padded = numel.div_ceil(w) * w;
        let shard = padded / w;
        let states = vec![format!("adamw.m/{name}"), format!("adamw.v/{name}")];
        for (r, vals) in per_rank.iter_mut().enumerate() {
            let data: Vec<f32> = (0..shard).map(|i| ((i + r) % 1000) as f32 * 1e-3).collect();
            vals.push((name.clone(), Tensor::f32(vec![shard], data.clone())));
            for s in &states {
                vals.push((s.clone(), Tensor::f32(vec![shard], data.clone())));
            }
            vals.push((format!("shard/{name}"), Tensor::f32(vec![shard], data)));
        }
        layouts.push(ParamLayout {
            name: name.clone(),
            shape: shape.clone(),
            numel,
            padded,
            optim_group: g.clone(),
            params_group: g.clone(),
            compute_shard: format!("shard/{name}"),
            compute_dtype: DType::F32,
            accumulate_group: None,
            states,
            expert_group: None,
        });
    }
    for vals in per_rank.iter_mut() {
        vals.push(("adamw.step".into(), Tensor::f32(vec![], vec![100.0])));
    }
    let manifest = Manifest {
        format: checkpoint::FORMAT,
        run: checkpoint::new_run_id(),
        step: 100,
        model: "gpt2-small shapes".into(),
        names: None,
        model_fingerprint: String::new(),
        plan_hash: String::new(),
        strategy: "zero3".into(),
        mesh: mesh.clone(),
        micro_batches: 1,
        layouts: layouts.clone(),
        data: None,
        schedule: None,
        lr: 1e-3,
        files: Vec::new(),
        manifest_sha256: String::new(),
    };
    println!(
        "GPT-2 small shapes: {numel_total} parameters, {w} ranks, {}",
        dir.display()
    );
    if std::env::var_os("HZP_BENCH_PARTS").is_some() {
        parts(&per_rank[0]);
    }
    let t0 = Instant::now();
    let (path, bytes) = checkpoint::save(&dir, manifest, &per_rank).unwrap();
    let write = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let c = checkpoint::load(&path).unwrap();
    let load = t1.elapsed().as_secs_f64();
    let t2 = Instant::now();
    let full = c.parameters().unwrap();
    let assemble = t2.elapsed().as_secs_f64();
    let gib = bytes as f64 / (1u64 << 30) as f64;
    println!(
        "  checkpoint  {:.2} GiB ({bytes} bytes) in {} files",
        gib,
        w + 1
    );
    println!(
        "  write       {:.2} s ({:.2} GiB/s, hashed and fsynced)",
        write,
        gib / write
    );
    println!(
        "  load        {:.2} s ({:.2} GiB/s, every file hashed)",
        load,
        gib / load
    );
    println!(
        "  full parameters put back together: {:.2} s ({} tensors)",
        assemble,
        full.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[allow(dead_code)]
fn parts(values: &[(String, Tensor)]) {
    use sha2::Digest;
    let t = Instant::now();
    let b = checkpoint::to_safetensors(values).unwrap();
    let ser = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let _ = sha2::Sha256::digest(&b);
    let h = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let _ = checkpoint::from_safetensors(&b).unwrap();
    let de = t.elapsed().as_secs_f64();
    println!(
        "  one rank: serialize {ser:.2} s, SHA-256 {h:.2} s, deserialize {de:.2} s ({} bytes)",
        b.len()
    );
}
