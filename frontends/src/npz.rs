//! `.npz` archives (being written).
