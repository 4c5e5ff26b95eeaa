//! Program evaluation on the CPU (being written).
