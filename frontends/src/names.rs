//! Name maps: which PyTorch `state_dict` keys each ONNX initializer stands for.
//!
//! PyTorch's ONNX exporters merge initializers with equal values (the norms of a fresh model
//! are all ones), fold expressions of parameters into new constants and rename weights
//! (`onnx::MatMul_737`, `val_244`). `frontends/python/hzp_export.py` exports a model so that
//! none of this can happen and writes `<stem>.names.json` beside it:
//!
//! ```json
//! {"format": "hzp.names/1",
//!  "initializers": {"lm_head.weight": [{"key": "model.embed_tokens.weight", "transpose": false},
//!                                      {"key": "lm_head.weight", "transpose": false}]},
//!  "ties": [["model.embed_tokens.weight", "lm_head.weight"]],
//!  "parameters": {"model.embed_tokens.weight": {"shape": [96, 32]}, ...}}
//! ```
//!
//! `initializers` gives, for every initializer that is a parameter, the keys it stands for
//! (`transpose`: the initializer holds the key's tensor with its two axes swapped). `ties`
//! lists the keys that are one tensor in PyTorch (a tied LM head). An initializer standing
//! for keys that PyTorch does not tie must say which ONNX nodes read each key (`"nodes":
//! [...]` on each entry); the importer then makes one parameter per key. `parameters` gives
//! every key's shape. The ONNX importer applies the map before translating
//! ([`crate::onnx::ImportOptions::names`]): parameters are named by their keys, in PyTorch's
//! layout, one per PyTorch tensor.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One key an initializer stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyUse {
    pub key: String,
    /// The initializer holds the transpose of the key's (2-D) tensor.
    pub transpose: bool,
    /// The ONNX nodes that read the initializer as this key (needed only when the
    /// initializer stands for keys PyTorch does not tie).
    pub nodes: Option<Vec<String>>,
}

/// A parsed `<stem>.names.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameMap {
    /// The file it was read from (for messages).
    pub path: PathBuf,
    /// Initializer name -> the keys it stands for, in file order.
    pub initializers: Vec<(String, Vec<KeyUse>)>,
    /// Groups of keys that are one tensor in PyTorch.
    pub ties: Vec<Vec<String>>,
    /// Every key's shape.
    pub shapes: BTreeMap<String, Vec<usize>>,
}

/// `<stem>.names.json` beside `model` (`gpt.onnx` -> `gpt.names.json`).
pub fn beside(model: &Path) -> PathBuf {
    model.with_extension("names.json")
}

impl NameMap {
    /// Reads and checks a name map.
    pub fn read(path: &Path) -> Result<NameMap, String> {
        let d = path.display();
        let bytes = crate::limits::read_regular(path)
            .map_err(|e| format!("name map {d} cannot be read: {e}"))?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("name map {d} is not JSON: {e}"))?;
        Self::from_json(&v, path)
    }

    /// Builds a map from its JSON form; `path` names it in messages.
    pub fn from_json(v: &serde_json::Value, path: &Path) -> Result<NameMap, String> {
        let d = path.display();
        let bad = |what: &str| {
            format!(
                "name map {d}: {what} (expected what hzp_export.py writes: `initializers`, `ties`, `parameters`)"
            )
        };
        if let Some(f) = v.get("format") {
            if f.as_str() != Some("hzp.names/1") {
                return Err(bad(&format!("format {f} is not \"hzp.names/1\"")));
            }
        }
        let inits = v
            .get("initializers")
            .and_then(|x| x.as_object())
            .ok_or_else(|| bad("no `initializers` object"))?;
        let mut initializers = Vec::new();
        for (name, uses) in inits {
            let uses = uses
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| bad(&format!("initializer `{name}` has no list of keys")))?;
            let mut list = Vec::new();
            for u in uses {
                let key = u.get("key").and_then(|k| k.as_str()).ok_or_else(|| {
                    bad(&format!("an entry of initializer `{name}` has no `key`"))
                })?;
                let transpose = u
                    .get("transpose")
                    .and_then(|t| t.as_bool())
                    .unwrap_or(false);
                let nodes = match u.get("nodes") {
                    None | Some(serde_json::Value::Null) => None,
                    Some(n) => Some(
                        n.as_array()
                            .and_then(|a| {
                                a.iter()
                                    .map(|x| x.as_str().map(str::to_string))
                                    .collect::<Option<Vec<_>>>()
                            })
                            .ok_or_else(|| {
                                bad(&format!("`nodes` of `{key}` is not a list of node names"))
                            })?,
                    ),
                };
                list.push(KeyUse {
                    key: key.to_string(),
                    transpose,
                    nodes,
                });
            }
            initializers.push((name.clone(), list));
        }
        let mut ties = Vec::new();
        if let Some(t) = v.get("ties") {
            for group in t.as_array().ok_or_else(|| bad("`ties` is not a list"))? {
                let g = group
                    .as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_str().map(str::to_string))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| bad("a tie is not a list of keys"))?;
                if g.len() >= 2 {
                    ties.push(g);
                }
            }
        }
        let params = v
            .get("parameters")
            .and_then(|x| x.as_object())
            .ok_or_else(|| bad("no `parameters` object"))?;
        let mut shapes = BTreeMap::new();
        for (k, p) in params {
            let s = p
                .get("shape")
                .and_then(|s| s.as_array())
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().map(|n| n as usize))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| bad(&format!("parameter `{k}` has no `shape` list")))?;
            shapes.insert(k.clone(), s);
        }
        let m = NameMap {
            path: path.to_path_buf(),
            initializers,
            ties,
            shapes,
        };
        m.check()?;
        Ok(m)
    }

    fn check(&self) -> Result<(), String> {
        let d = self.path.display();
        let mut seen = BTreeSet::new();
        for g in &self.ties {
            for k in g {
                if !self.shapes.contains_key(k) {
                    return Err(format!(
                        "name map {d}: tie names `{k}`, which is not in its `parameters`"
                    ));
                }
                if !seen.insert(k.clone()) {
                    return Err(format!("name map {d}: `{k}` is in two ties"));
                }
            }
        }
        for (init, uses) in &self.initializers {
            for u in uses {
                if !self.shapes.contains_key(&u.key) {
                    return Err(format!(
                        "name map {d}: initializer `{init}` stands for `{}`, which is not in its `parameters`",
                        u.key
                    ));
                }
            }
        }
        Ok(())
    }

    /// The key that names `key`'s tensor: the first key of its tie, else itself.
    pub fn canonical<'a>(&'a self, key: &'a str) -> &'a str {
        self.ties
            .iter()
            .find(|g| g.iter().any(|k| k == key))
            .map_or(key, |g| g[0].as_str())
    }

    /// `(canonical, copy)` for every key that PyTorch ties to another: the program trains the
    /// canonical one; what hzp writes carries the copy too (a strict `load_state_dict` wants
    /// every key).
    pub fn tie_copies(&self) -> Vec<(String, String)> {
        self.ties
            .iter()
            .flat_map(|g| g[1..].iter().map(|c| (g[0].clone(), c.clone())))
            .collect()
    }
}

/// The name map for `model`: `explicit` (`--names FILE`), else `<stem>.names.json` beside an
/// `.onnx` model when it exists; `None` for other models.
pub fn find_for_model(model: &str, explicit: Option<&Path>) -> Result<Option<NameMap>, String> {
    if let Some(p) = explicit {
        if model.starts_with("preset:") || !model.to_ascii_lowercase().ends_with(".onnx") {
            return Err(format!(
                "--names {}: a name map applies to ONNX models, not to {model}",
                p.display()
            ));
        }
        return NameMap::read(p).map(Some);
    }
    if model.starts_with("preset:") {
        return Ok(None);
    }
    let path = Path::new(model);
    if !path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
    {
        return Ok(None);
    }
    let b = beside(path);
    if b.is_file() {
        NameMap::read(&b).map(Some)
    } else {
        Ok(None)
    }
}
