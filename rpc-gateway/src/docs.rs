//! The documentation page served at `/docs`, with its assets built in.
//!
//! Why a page of its own rather than a packaged API explorer: the page must work where the
//! gateway runs, often with no internet access, so nothing may be fetched at build or run time
//! (no CDN, no web fonts), and it should stay small enough to read. Its HTML, CSS and JavaScript
//! live in `rpc-gateway/assets/` and are compiled into the binary; the page reads `openapi.json`
//! (a URL relative to itself, so it works behind a path prefix) from the gateway serving it and
//! shows services, operations, parameters, schemas and error answers, with a "try it" form per
//! operation that sends the request and shows the status and body.

/// The whole page: one HTML document with its style and script inline.
const PAGE: &str = concat!(
    "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
    "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n",
    "<title>API</title>\n<style>\n",
    include_str!("../assets/docs.css"),
    "</style>\n</head>\n<body>\n",
    include_str!("../assets/docs.html"),
    "<script>\n",
    include_str!("../assets/docs.js"),
    "</script>\n</body>\n</html>\n",
);

/// The page's HTML; it reads `openapi.json` (relative to the page: `/openapi.json` when served
/// at `/docs`) from the gateway that serves it. Serve it as `text/html; charset=utf-8`.
pub fn page() -> &'static str {
    PAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_fetches_nothing_from_other_hosts() {
        let page = page().to_ascii_lowercase();
        for needle in ["http://", "https://", "src=\"//", "href=\"//", "fetch(\"//"] {
            assert!(!page.contains(needle), "the page refers to {needle:?}");
        }
        let css = include_str!("../assets/docs.css").to_ascii_lowercase();
        for needle in ["url(", "@import", "@font-face"] {
            assert!(
                !css.contains(needle),
                "the style loads something: {needle:?}"
            );
        }
        for needle in ["<script src", "<link"] {
            assert!(
                !page.contains(needle),
                "the page loads an asset: {needle:?}"
            );
        }
    }

    #[test]
    fn the_page_reads_the_document_relative_to_itself() {
        assert!(page().contains("fetch(\"openapi.json\""));
    }

    #[test]
    fn the_page_is_one_html_document_with_its_script_and_style_inline() {
        let page = page();
        assert!(page.starts_with("<!doctype html>"));
        assert_eq!(page.matches("<script>").count(), 1);
        assert_eq!(page.matches("</script>").count(), 1);
        assert_eq!(page.matches("<style>").count(), 1);
        assert!(page.trim_end().ends_with("</html>"));
    }
}
