//! The parser's error: a message, the offending span, and the whole source for rendering.

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode, SourceSpan};
use std::fmt;

/// An error in a `.hzp` text. `Display` gives `file:line:col: message`; as a
/// [`miette::Diagnostic`] it renders the source line with a label under the offending token.
#[derive(Clone)]
pub struct ParseError(Box<Inner>);

#[derive(Clone)]
struct Inner {
    message: String,
    label: String,
    help: Option<String>,
    file: String,
    line: usize,
    column: usize,
    span: SourceSpan,
    source_code: NamedSource<String>,
}

impl ParseError {
    /// Builds an error at byte range `start..end` of `src`; `line`/`column` are computed here.
    pub(crate) fn new(
        src: &str,
        file: &str,
        start: usize,
        end: usize,
        message: String,
        label: String,
        help: Option<String>,
    ) -> ParseError {
        let start = floor_char_boundary(src, start.min(src.len()));
        let end = floor_char_boundary(src, end.clamp(start, src.len()));
        let before = &src[..start];
        let line = before.bytes().filter(|&b| b == b'\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = src[line_start..start].chars().count() + 1;
        ParseError(Box::new(Inner {
            message,
            label,
            help,
            file: file.to_string(),
            line,
            column,
            span: SourceSpan::new(start.into(), end - start),
            source_code: NamedSource::new(file, src.to_string()),
        }))
    }

    /// The message, without the location.
    pub fn message(&self) -> &str {
        &self.0.message
    }

    /// The file name given to the parser.
    pub fn file(&self) -> &str {
        &self.0.file
    }

    /// 1-based line of the offending token.
    pub fn line(&self) -> usize {
        self.0.line
    }

    /// 1-based column (in characters, not bytes) of the offending token.
    pub fn column(&self) -> usize {
        self.0.column
    }

    /// Byte range of the offending token in the source.
    pub fn span(&self) -> SourceSpan {
        self.0.span
    }

    /// A hint on how to fix it, when there is one.
    pub fn help_text(&self) -> Option<&str> {
        self.0.help.as_deref()
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.0.file, self.0.line, self.0.column, self.0.message
        )
    }
}

impl fmt::Debug for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParseError")
            .field("file", &self.0.file)
            .field("line", &self.0.line)
            .field("column", &self.0.column)
            .field("message", &self.0.message)
            .field("label", &self.0.label)
            .field("help", &self.0.help)
            .finish()
    }
}

impl std::error::Error for ParseError {}

impl Diagnostic for ParseError {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new("hzp::text::parse"))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.0
            .help
            .as_ref()
            .map(|h| Box::new(h.as_str()) as Box<dyn fmt::Display + 'a>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        Some(&self.0.source_code)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(std::iter::once(LabeledSpan::new_with_span(
            Some(self.0.label.clone()),
            self.0.span,
        ))))
    }
}
