//! Program summaries for `hzp show` (being written).
