//! Finding the CUDA libraries before anything touches them.
//!
//! cudarc loads the driver, NVRTC, cuBLAS and NCCL lazily by file name and panics when one is
//! missing, so the CUDA backend asks this module first. [`probe`] tries the names cudarc tries
//! (what the dynamic loader finds through `LD_LIBRARY_PATH`, the loader cache and the system
//! directories) and, for a library the loader cannot find, looks in the usual install places
//! (`CUDA_HOME`/`CUDA_PATH`, `/usr/local/cuda`, pip's `nvidia/*/lib`). [`Probe::require`] turns
//! the result into one error that names each missing library, where it was looked for and
//! what to do; [`Probe::preload`] loads libraries found outside the loader's path by their
//! full path, so cudarc's later load by name finds them (the loader matches a loaded
//! library's soname).
//!
//! Nothing here needs the `cuda` feature: `hzp run --backend cuda` on a build without it
//! still says which libraries this machine lacks.

use std::ffi::{CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};

/// A library the CUDA backend loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lib {
    /// The CUDA driver (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler the kernels are compiled with (`libnvrtc.so.12`).
    Nvrtc,
    /// cuBLAS (`libcublas.so.12`), for matrix products.
    Cublas,
    /// cuBLASLt (`libcublasLt.so.12`), which cuBLAS itself loads.
    CublasLt,
    /// NCCL (`libnccl.so.2`), for collectives.
    Nccl,
    /// cuDNN 9 (`libcudnn.so.9`), for fused attention (optional: without it hzp's own
    /// attention kernels run).
    Cudnn,
}

impl Lib {
    pub const ALL: [Lib; 6] = [
        Lib::Driver,
        Lib::Nvrtc,
        Lib::Cublas,
        Lib::CublasLt,
        Lib::Nccl,
        Lib::Cudnn,
    ];

    /// The file name people know the library by.
    pub fn file_name(self) -> &'static str {
        match self {
            Lib::Driver => "libcuda.so.1",
            Lib::Nvrtc => "libnvrtc.so.12",
            Lib::Cublas => "libcublas.so.12",
            Lib::CublasLt => "libcublasLt.so.12",
            Lib::Nccl => "libnccl.so.2",
            Lib::Cudnn => "libcudnn.so.9",
        }
    }

    /// What the library is, for messages.
    pub fn description(self) -> &'static str {
        match self {
            Lib::Driver => "the CUDA driver library",
            Lib::Nvrtc => "the NVRTC runtime compiler library",
            Lib::Cublas => "the cuBLAS library",
            Lib::CublasLt => "the cuBLASLt library",
            Lib::Nccl => "the NCCL library",
            Lib::Cudnn => "the cuDNN library",
        }
    }

    /// How to get it.
    pub fn remedy(self) -> &'static str {
        match self {
            Lib::Driver => "install the NVIDIA driver or set LD_LIBRARY_PATH",
            Lib::Nvrtc => {
                "install the CUDA 12 toolkit (or `pip install nvidia-cuda-nvrtc-cu12`) or set LD_LIBRARY_PATH"
            }
            Lib::Cublas | Lib::CublasLt => {
                "install the CUDA 12 toolkit (or `pip install nvidia-cublas-cu12`) or set LD_LIBRARY_PATH"
            }
            Lib::Nccl => "install NCCL 2 (or `pip install nvidia-nccl-cu12`) or set LD_LIBRARY_PATH",
            Lib::Cudnn => {
                "install cuDNN 9 for CUDA 12 (or `pip install nvidia-cudnn-cu12`) or set LD_LIBRARY_PATH"
            }
        }
    }

    /// The stem cudarc builds its candidate names from.
    fn stem(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Nvrtc => "nvrtc",
            Lib::Cublas => "cublas",
            Lib::CublasLt => "cublasLt",
            Lib::Nccl => "nccl",
            Lib::Cudnn => "cudnn",
        }
    }

    /// The names cudarc (built for CUDA 12) passes to the dynamic loader, in its order.
    pub fn loader_names(self) -> Vec<String> {
        let s = self.stem();
        let mut v = vec![format!("lib{s}.so")];
        for sfx in ["12", "11", "10", "9", "1"] {
            v.push(format!("lib{s}.so.{sfx}"));
        }
        v
    }

    /// A symbol the library exports (to find its path once loaded).
    fn symbol(self) -> &'static str {
        match self {
            Lib::Driver => "cuInit",
            Lib::Nvrtc => "nvrtcVersion",
            Lib::Cublas => "cublasCreate_v2",
            Lib::CublasLt => "cublasLtCreate",
            Lib::Nccl => "ncclGetVersion",
            Lib::Cudnn => "cudnnGetVersion",
        }
    }

    /// Whether a file name in a directory is this library (any version suffix).
    fn matches_file(self, name: &str) -> bool {
        let prefix = format!("lib{}.so", self.stem());
        name == prefix || name.starts_with(&format!("{prefix}."))
    }
}

impl fmt::Display for Lib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.file_name())
    }
}

/// Where a library stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LibState {
    /// The dynamic loader finds it under `name` (what cudarc will load); `path` where it is.
    Loadable { name: String, path: Option<PathBuf> },
    /// Not on the loader's path, but this file is: [`Probe::preload`] can load it.
    Found { path: PathBuf },
    /// Nowhere.
    Missing,
}

/// The result of [`probe`].
#[derive(Clone, Debug)]
pub struct Probe {
    pub libs: Vec<(Lib, LibState)>,
    /// The directories looked in, in order (after the loader's own search).
    pub searched: Vec<PathBuf>,
}

/// Environment lookup, so tests can probe with an environment of their own.
pub type EnvFn<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Probes every library in [`Lib::ALL`] with the process environment.
pub fn probe() -> Probe {
    probe_with(&|k| std::env::var(k).ok(), true)
}

/// Probes with `env` for the directories to search. With `try_loader` false the dynamic
/// loader is not asked (only files in the searched directories count).
pub fn probe_with(env: EnvFn<'_>, try_loader: bool) -> Probe {
    probe_in(search_dirs(env), try_loader)
}

/// Probes searching only `dirs` (after the loader, when `try_loader`).
pub fn probe_in(searched: Vec<PathBuf>, try_loader: bool) -> Probe {
    let libs = Lib::ALL
        .iter()
        .map(|&lib| {
            let state = if let Some(s) = try_loader.then(|| loadable(lib)).flatten() {
                s
            } else if let Some(path) = find_file(lib, &searched) {
                LibState::Found { path }
            } else {
                LibState::Missing
            };
            (lib, state)
        })
        .collect();
    Probe { libs, searched }
}

impl Probe {
    pub fn state(&self, lib: Lib) -> &LibState {
        self.libs
            .iter()
            .find(|(l, _)| *l == lib)
            .map(|(_, s)| s)
            .unwrap_or(&LibState::Missing)
    }

    /// The libraries neither the loader nor the search found.
    pub fn missing(&self) -> Vec<Lib> {
        self.libs
            .iter()
            .filter(|(_, s)| *s == LibState::Missing)
            .map(|(l, _)| *l)
            .collect()
    }

    /// Directories of libraries that were found outside the loader's path (what a launcher
    /// should prepend to its children's `LD_LIBRARY_PATH`), in first-seen order.
    pub fn extra_dirs(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = Vec::new();
        for (_, s) in &self.libs {
            if let LibState::Found { path } = s {
                if let Some(d) = path.parent() {
                    if !out.iter().any(|x| x == d) {
                        out.push(d.to_path_buf());
                    }
                }
            }
        }
        out
    }

    /// `Ok` when every library of `need` is loadable or found; otherwise one error naming each
    /// missing library, the places searched and the remedy, prefixed with `context` (e.g.
    /// `hzp run --backend cuda`).
    pub fn require(&self, need: &[Lib], context: &str) -> Result<(), String> {
        let missing: Vec<Lib> = need
            .iter()
            .copied()
            .filter(|l| *self.state(*l) == LibState::Missing)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let searched = self.searched_text();
        let lines: Vec<String> = missing
            .iter()
            .map(|l| {
                format!(
                    "{context}: {} {} was not found (searched: {searched}); {}",
                    l.description(),
                    l.file_name(),
                    l.remedy()
                )
            })
            .collect();
        Err(lines.join("\n"))
    }

    fn searched_text(&self) -> String {
        let mut parts =
            vec!["the dynamic loader's path (LD_LIBRARY_PATH, ld.so.cache)".to_string()];
        parts.extend(self.searched.iter().map(|d| d.display().to_string()));
        parts.join(", ")
    }

    /// Loads every library of `need` that was found outside the loader's path by its full
    /// path (global, never unloaded), so that cudarc's load by name finds the loaded copy.
    /// NCCL cannot be helped this way (cudarc asks for `libnccl.so`, the library calls itself
    /// `libnccl.so.2`): for it the error says to put its directory on `LD_LIBRARY_PATH`
    /// with a `libnccl.so` link (what `hzp launch` does for its children).
    pub fn preload(&self, need: &[Lib]) -> Result<(), String> {
        // cuBLASLt before cuBLAS: cuBLAS needs it
        let mut order: Vec<Lib> = need.to_vec();
        if order.contains(&Lib::Cublas) && !order.contains(&Lib::CublasLt) {
            order.push(Lib::CublasLt);
        }
        order.sort_by_key(|l| (*l != Lib::CublasLt, *l));
        for lib in order {
            let LibState::Found { path } = self.state(lib) else {
                continue;
            };
            if lib == Lib::Nccl {
                let dir = path.parent().unwrap_or(Path::new("."));
                return Err(format!(
                    "NCCL was found at {}, which is not on the dynamic loader's path, and cudarc loads it by the name libnccl.so: \
run under `hzp launch` (it sets up the path), or `mkdir -p ~/.hzp-lib && ln -sf {} ~/.hzp-lib/libnccl.so` and \
`export LD_LIBRARY_PATH=~/.hzp-lib:{}:$LD_LIBRARY_PATH`",
                    path.display(),
                    path.display(),
                    dir.display()
                ));
            }
            if lib == Lib::Cudnn {
                // cuDNN 9 loads its parts (graph, engines, heuristics) by name when used:
                // loaded first from the same directory, the loader finds them by soname
                if let Some(dir) = path.parent() {
                    for part in CUDNN_PARTS {
                        if let Some(b) = first_file(dir, |n| {
                            n == format!("lib{part}.so.9")
                                || n.starts_with(&format!("lib{part}.so.9."))
                        }) {
                            open_global(&b)?;
                        }
                    }
                }
            }
            if lib == Lib::Nvrtc {
                // NVRTC loads its builtins library by name at compile time
                if let Some(dir) = path.parent() {
                    if let Some(b) = first_file(dir, |n| {
                        n.starts_with("libnvrtc-builtins.so") && !n.contains(".alt.")
                    }) {
                        open_global(&b)?;
                    }
                }
            }
            open_global(path)?;
        }
        Ok(())
    }
}

/// The parts of cuDNN 9 that `libcudnn.so.9` loads by name, in dependency order.
const CUDNN_PARTS: [&str; 7] = [
    "cudnn_graph",
    "cudnn_engines_precompiled",
    "cudnn_engines_runtime_compiled",
    "cudnn_heuristic",
    "cudnn_ops",
    "cudnn_cnn",
    "cudnn_adv",
];

/// The directories searched after the loader: `LD_LIBRARY_PATH`, the CUDA install
/// variables, `/usr/local/cuda`, the distributions' library directories, WSL's driver
/// directory and pip's `nvidia/*/lib` under the active virtual environment, the user's site
/// packages and the system's. Existing directories only, each once.
pub fn search_dirs(env: EnvFn<'_>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = env("LD_LIBRARY_PATH") {
        dirs.extend(p.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = env(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
            dirs.push(root.join("targets/x86_64-linux/lib"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut site_roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = env("VIRTUAL_ENV") {
        site_roots.push(PathBuf::from(v).join("lib"));
    }
    if let Some(v) = env("CONDA_PREFIX") {
        site_roots.push(PathBuf::from(&v).join("lib"));
        dirs.push(PathBuf::from(v).join("lib"));
    }
    if let Some(h) = env("HOME") {
        site_roots.push(PathBuf::from(h).join(".local/lib"));
    }
    site_roots.push(PathBuf::from("/usr/local/lib"));
    site_roots.push(PathBuf::from("/usr/lib"));
    for root in site_roots {
        for py in sorted_entries(&root, |n| n.starts_with("python3")) {
            for pkgs in ["site-packages", "dist-packages"] {
                let nv = py.join(pkgs).join("nvidia");
                for sub in sorted_entries(&nv, |_| true) {
                    dirs.push(sub.join("lib"));
                }
            }
        }
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

fn sorted_entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

fn first_file(dir: &Path, keep: impl Fn(&str) -> bool) -> Option<PathBuf> {
    sorted_entries(dir, keep).into_iter().find(|p| p.is_file())
}

/// The library's file in the first directory that has one: the name people know
/// (`libcuda.so.1`) first, then any `lib<stem>.so*`.
fn find_file(lib: Lib, dirs: &[PathBuf]) -> Option<PathBuf> {
    for d in dirs {
        let exact = d.join(lib.file_name());
        if exact.is_file() {
            return Some(exact);
        }
        if let Some(p) = first_file(d, |n| lib.matches_file(n)) {
            return Some(p);
        }
    }
    None
}

#[cfg(unix)]
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a valid C string owned by the loader.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Asks the dynamic loader for the names cudarc uses; the first that loads wins.
#[cfg(unix)]
fn loadable(lib: Lib) -> Option<LibState> {
    for name in lib.loader_names() {
        let c = CString::new(name.clone()).ok()?;
        // SAFETY: dlopen with a valid C string; the handle is closed below (the library
        // stays loaded while someone else holds it).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if h.is_null() {
            continue;
        }
        let path = lib_path(h, lib.symbol());
        // SAFETY: h came from dlopen above.
        unsafe { libc::dlclose(h) };
        return Some(LibState::Loadable { name, path });
    }
    None
}

#[cfg(not(unix))]
fn loadable(_lib: Lib) -> Option<LibState> {
    None
}

#[cfg(unix)]
fn lib_path(h: *mut libc::c_void, symbol: &str) -> Option<PathBuf> {
    let sym = CString::new(symbol).ok()?;
    // SAFETY: h is a live handle; dladdr only reads loader tables.
    unsafe {
        let p = libc::dlsym(h, sym.as_ptr());
        if p.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(p, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(PathBuf::from(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        ))
    }
}

/// Loads `path` globally and keeps it loaded for the life of the process.
#[cfg(unix)]
fn open_global(path: &Path) -> Result<(), String> {
    let c = CString::new(path.to_string_lossy().into_owned())
        .map_err(|_| format!("{}: the path holds a NUL byte", path.display()))?;
    // SAFETY: dlopen with a valid C string; the handle is deliberately never closed.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(format!("could not load {}: {}", path.display(), dl_error()));
    }
    Ok(())
}

#[cfg(not(unix))]
fn open_global(path: &Path) -> Result<(), String> {
    Err(format!(
        "could not load {}: the CUDA backend supports Linux only",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_names_include_what_the_libraries_are_called() {
        assert!(Lib::Driver.loader_names().contains(&"libcuda.so.1".into()));
        assert!(Lib::Nvrtc.loader_names().contains(&"libnvrtc.so.12".into()));
        assert!(Lib::Cublas
            .loader_names()
            .contains(&"libcublas.so.12".into()));
        // cudarc never asks for libnccl.so.2 (hence preload's advice)
        assert!(!Lib::Nccl.loader_names().contains(&"libnccl.so.2".into()));
        assert!(Lib::Nccl.matches_file("libnccl.so.2"));
        assert!(!Lib::Cublas.matches_file("libcublasLt.so.12"));
        assert!(Lib::CublasLt.matches_file("libcublasLt.so.12"));
        // cudarc asks for libcudnn.so.9 among its names; cuDNN's parts are not cuDNN itself
        assert!(Lib::Cudnn.loader_names().contains(&"libcudnn.so.9".into()));
        assert!(Lib::Cudnn.matches_file("libcudnn.so.9.1.0"));
        assert!(!Lib::Cudnn.matches_file("libcudnn_graph.so.9"));
    }
}
