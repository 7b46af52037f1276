"""An attached PDF's text reaches the chat as context: `pdf_text` reads it with pypdf (the
page's /api/extract route), and a file that is not a PDF is one clear 400."""

import pytest

from lmforge.serve.app import pdf_text
from lmforge.serve.guards import APIError

pytest.importorskip("pypdf")


def one_page_pdf(text: str) -> bytes:
    """A minimal one-page PDF showing `text` in Helvetica, with a correct cross-reference table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def test_pdf_text_reads_the_page():
    assert "the river Cam floods in March" in pdf_text(
        one_page_pdf("the river Cam floods in March")
    )


def test_a_file_that_is_not_a_pdf_is_one_400():
    with pytest.raises(APIError) as err:
        pdf_text(b"plain text, not a PDF")
    assert err.value.status == 400 and "not a readable PDF" in str(err.value)
