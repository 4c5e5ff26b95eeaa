use hzp_frontends::onnx::*;
use hzp_ir::Tensor;
#[test]
fn nodetests() {
    let root = std::path::Path::new("/tmp/nodetests/cases");
    let mut dirs: Vec<_> = std::fs::read_dir(root).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    let (mut pass, mut unsup, mut ierr, mut eerr, mut wrong) = (0, 0, 0, 0, 0);
    let mut lines = vec![];
    for d in dirs {
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let ins = match hzp_frontends::npz::read(&d.join("inputs.npz")) { Ok(v) => v, Err(e) => { lines.push(format!("NPZ {name}: {e}")); continue } };
        let outs = match hzp_frontends::npz::read(&d.join("outputs.npz")) { Ok(v) => v, Err(e) => { lines.push(format!("NPZ {name}: {e}")); continue } };
        let mut o = ImportOptions::default();
        for (n, t) in &ins { o.shapes.insert(n.clone(), t.shape.clone()); }
        let r = std::panic::catch_unwind(|| import_file(&d.join("model.onnx"), &o));
        let p = match r {
            Err(_) => { lines.push(format!("PANIC-IMPORT {name}")); ierr += 1; continue }
            Ok(Err(e)) if e.kind == ImportErrorKind::Unsupported => { unsup += 1; lines.push(format!("UNSUP {name}: {}", e.message)); continue }
            Ok(Err(e)) => { ierr += 1; lines.push(format!("IMPORTERR {name}: {}", e.message)); continue }
            Ok(Ok(p)) => p,
        };
        let feed: Vec<(String, Tensor)> = ins.clone();
        let r = std::panic::catch_unwind(|| hzp_runtime::eval::evaluate(&p, &feed));
        let got = match r {
            Err(_) => { lines.push(format!("PANIC-EVAL {name}")); eerr += 1; continue }
            Ok(Err(e)) => { eerr += 1; lines.push(format!("EVALERR {name}: {e}")); continue }
            Ok(Ok(g)) => g,
        };
        let mut bad = None;
        for (n, want) in &outs {
            let Some((_, g)) = got.iter().find(|(gn, _)| gn == n) else { bad = Some(format!("missing output {n}")); break };
            if g.shape != want.shape { bad = Some(format!("{n}: shape {:?} vs {:?}", g.shape, want.shape)); break }
            if g.dtype() != want.dtype() { bad = Some(format!("{n}: dtype {} vs {}", g.dtype(), want.dtype())); break }
            let (a, b) = (g.to_f64_vec(), want.to_f64_vec());
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-4 * (1.0 + y.abs());
                if !ok { bad = Some(format!("{n}[{i}]: {x} vs {y}")); break }
            }
            if bad.is_some() { break }
        }
        match bad { None => pass += 1, Some(b) => { wrong += 1; lines.push(format!("WRONG {name}: {b}")) } }
    }
    std::fs::write("/tmp/nodetests/report.txt", lines.join("\n")).unwrap();
    println!("pass {pass} unsupported {unsup} import-error {ierr} eval-error {eerr} wrong {wrong}");
}
