//! The text form of programs (`*.hzp`): a deterministic printer and a parser that reads it
//! back (`parse(print(p)) == p`). Being written; see the issue tracker.
