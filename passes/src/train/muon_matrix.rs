//! The shape of a matrix Muon updates ([`MuonMatrix`]): what the Muon update
//! (`train::muon`) and the Canzona placement of its Newton-Schulz work (`train::canzona`)
//! both read, so neither imports the other for it.

/// A parameter Muon updates: its stored shape and its shape as a linear map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MuonMatrix {
    pub rows: usize,
    pub cols: usize,
    /// A: output features.
    pub out_features: usize,
    /// B: input features.
    pub in_features: usize,
}

impl MuonMatrix {
    /// Multiply-adds of one Newton-Schulz run (5 steps): per step `X Xᵀ` (s·s·l), `G G`
    /// (s·s·s) and `H X` (s·s·l), with s the smaller and l the larger side.
    pub fn ns_flops(&self, steps: usize) -> u64 {
        let (s, l) = (
            self.rows.min(self.cols) as u64,
            self.rows.max(self.cols) as u64,
        );
        2 * steps as u64 * (2 * s * s * l + s * s * s)
    }
}
