//! Tokens of the text form. Newlines are tokens (statements are line-oriented); `#` starts a
//! comment that runs to the end of the line.

use std::borrow::Cow;

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok<'a> {
    /// `[A-Za-z_][A-Za-z0-9_.]*`: keywords, op names, dtypes, attribute keys and words.
    Word(&'a str),
    /// `-?digits[.digits][e[+-]digits]`, or `-inf`.
    Num(&'a str),
    /// `%name` or `%"quoted name"`.
    Value(Cow<'a, str>),
    /// `"..."` with escapes.
    Str(Cow<'a, str>),
    /// One of `= , : ( ) { } [ ] @`.
    Punct(char),
    Newline,
    Eof,
}

impl Tok<'_> {
    /// How an error message names this token.
    pub(crate) fn describe(&self) -> String {
        match self {
            Tok::Word(w) => format!("`{w}`"),
            Tok::Num(n) => format!("number `{n}`"),
            Tok::Value(v) => format!("`{}`", super::value_ref(v)),
            Tok::Str(s) => format!("string {}", super::quote(s)),
            Tok::Punct(c) => format!("`{c}`"),
            Tok::Newline => "the end of the line".to_string(),
            Tok::Eof => "the end of the file".to_string(),
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Token<'a> {
    pub tok: Tok<'a>,
    pub start: usize,
    pub end: usize,
}

/// A lexing problem at a byte range.
#[derive(Debug)]
pub(crate) struct LexError {
    pub start: usize,
    pub end: usize,
    pub message: String,
    pub label: String,
}

/// Characters allowed in a value name printed without quotes.
pub(crate) fn is_bare_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '/')
}

pub(crate) fn is_word_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

pub(crate) fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

pub(crate) fn lex(src: &str) -> Result<Vec<Token<'_>>, LexError> {
    let bytes = src.as_bytes();
    let mut toks = Vec::with_capacity(src.len() / 4 + 1);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let start = i;
        match b {
            b' ' | b'\t' | b'\r' => i += 1,
            b'\n' => {
                toks.push(Token {
                    tok: Tok::Newline,
                    start,
                    end: i + 1,
                });
                i += 1;
            }
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'=' | b',' | b':' | b'(' | b')' | b'{' | b'}' | b'[' | b']' | b'@' => {
                toks.push(Token {
                    tok: Tok::Punct(b as char),
                    start,
                    end: i + 1,
                });
                i += 1;
            }
            b'"' => {
                let (s, end) = lex_string(src, i)?;
                toks.push(Token {
                    tok: Tok::Str(s),
                    start,
                    end,
                });
                i = end;
            }
            b'%' => {
                i += 1;
                if i < bytes.len() && bytes[i] == b'"' {
                    let (s, end) = lex_string(src, i)?;
                    toks.push(Token {
                        tok: Tok::Value(s),
                        start,
                        end,
                    });
                    i = end;
                } else {
                    while i < bytes.len() && is_bare_name_char(bytes[i] as char) {
                        i += 1;
                    }
                    if i == start + 1 {
                        return Err(LexError {
                            start,
                            end: start + 1,
                            message: "expected a value name after `%`".into(),
                            label: "a name like %x or %\"any name\" goes here".into(),
                        });
                    }
                    toks.push(Token {
                        tok: Tok::Value(Cow::Borrowed(&src[start + 1..i])),
                        start,
                        end: i,
                    });
                }
            }
            b'-' | b'0'..=b'9' => {
                let end = lex_number(src, i)?;
                toks.push(Token {
                    tok: Tok::Num(&src[start..end]),
                    start,
                    end,
                });
                i = end;
            }
            _ if is_word_start(b as char) => {
                while i < bytes.len() && is_word_char(bytes[i] as char) {
                    i += 1;
                }
                toks.push(Token {
                    tok: Tok::Word(&src[start..i]),
                    start,
                    end: i,
                });
            }
            _ => {
                let c = src[i..].chars().next().unwrap_or('?');
                return Err(LexError {
                    start,
                    end: start + c.len_utf8(),
                    message: format!("unexpected character `{}`", c.escape_debug()),
                    label: "not part of the text form".into(),
                });
            }
        }
    }
    toks.push(Token {
        tok: Tok::Eof,
        start: src.len(),
        end: src.len(),
    });
    Ok(toks)
}

/// Lexes a number starting at `start`; returns its end.
fn lex_number(src: &str, start: usize) -> Result<usize, LexError> {
    let bytes = src.as_bytes();
    let mut i = start;
    let bad = |end: usize, msg: &str| LexError {
        start,
        end,
        message: msg.to_string(),
        label: "here".into(),
    };
    if bytes[i] == b'-' {
        i += 1;
        if src[i..].starts_with("inf") && !src[i + 3..].chars().next().is_some_and(is_word_char) {
            return Ok(i + 3);
        }
        if i >= bytes.len() || !bytes[i].is_ascii_digit() {
            return Err(bad(i, "expected a number after `-`"));
        }
    }
    let digits = |i: &mut usize| {
        let s = *i;
        while *i < bytes.len() && bytes[*i].is_ascii_digit() {
            *i += 1;
        }
        *i > s
    };
    digits(&mut i);
    if i < bytes.len() && bytes[i] == b'.' {
        i += 1;
        if !digits(&mut i) {
            return Err(bad(i, "malformed number: expected digits after `.`"));
        }
    }
    if i < bytes.len() && (bytes[i] == b'e' || bytes[i] == b'E') {
        i += 1;
        if i < bytes.len() && (bytes[i] == b'+' || bytes[i] == b'-') {
            i += 1;
        }
        if !digits(&mut i) {
            return Err(bad(i, "malformed number: expected digits in the exponent"));
        }
    }
    if let Some(c) = src[i..].chars().next() {
        if is_word_char(c) {
            let mut end = i;
            for (k, c) in src[i..].char_indices() {
                if !is_word_char(c) {
                    break;
                }
                end = i + k + c.len_utf8();
            }
            return Err(bad(end, "malformed number"));
        }
    }
    Ok(i)
}

/// Lexes a quoted string whose `"` is at `start`; returns its contents and end.
fn lex_string(src: &str, start: usize) -> Result<(Cow<'_, str>, usize), LexError> {
    let body = start + 1;
    let mut out: Option<String> = None;
    let mut iter = src[body..].char_indices();
    let unterminated = || LexError {
        start,
        end: start + 1,
        message: "unterminated string".into(),
        label: "this quote is never closed on its line".into(),
    };
    while let Some((k, c)) = iter.next() {
        let at = body + k;
        match c {
            '"' => {
                let s = match out {
                    Some(s) => Cow::Owned(s),
                    None => Cow::Borrowed(&src[body..at]),
                };
                return Ok((s, at + 1));
            }
            '\n' => return Err(unterminated()),
            '\\' => {
                let buf = out.get_or_insert_with(|| src[body..at].to_string());
                let Some((_, e)) = iter.next() else {
                    return Err(unterminated());
                };
                let bad_escape = |end: usize| LexError {
                    start: at,
                    end,
                    message: "invalid escape in string".into(),
                    label: "use \\\\, \\\", \\n, \\t, \\r, \\0 or \\u{hex}".into(),
                };
                match e {
                    '\\' => buf.push('\\'),
                    '"' => buf.push('"'),
                    'n' => buf.push('\n'),
                    't' => buf.push('\t'),
                    'r' => buf.push('\r'),
                    '0' => buf.push('\0'),
                    'u' => {
                        let rest = &src[at + 2..];
                        let close = rest.find('}').filter(|_| rest.starts_with('{'));
                        let Some(close) = close else {
                            return Err(bad_escape(at + 2));
                        };
                        let hex = &rest[1..close];
                        let end = at + 2 + close + 1;
                        let ch = (hex.len() <= 6 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
                            .then(|| u32::from_str_radix(hex, 16).ok())
                            .flatten()
                            .and_then(char::from_u32);
                        let Some(ch) = ch else {
                            return Err(bad_escape(end));
                        };
                        buf.push(ch);
                        // skip the `{hex}` part
                        while let Some((k2, _)) = iter.clone().next() {
                            if body + k2 >= end {
                                break;
                            }
                            iter.next();
                        }
                    }
                    _ => return Err(bad_escape(at + 1 + e.len_utf8())),
                }
            }
            _ => {
                if let Some(buf) = out.as_mut() {
                    buf.push(c);
                }
            }
        }
    }
    Err(unterminated())
}
