"""Render the bundled image eval set: synthetic document pages (receipts and personnel-change notices, Japanese and
English) with their gold JSON, for ``hayabusa eval`` on a vision-language model.

    python examples/doc_images/make_doc_images.py [--out examples/doc_images] [--seed 0] [--font FILE.ttf]

Every store, company and person is drawn at random from the fictional lists below (``numpy.random.default_rng``
seeded), so the documents and the gold answers are the same on every run. Pages are rendered with Pillow in
grayscale PNG; Japanese needs a CJK font: ``--font``, ``$HAYABUSA_CJK_FONT``, or one of ``CJK_FONTS`` (Debian:
``apt-get install fonts-ipaexfont-gothic``). The rendered PNGs are committed (8 items, 12 pages), so a machine
without the font still has the set; ``draw_documents`` (the gold answers) needs no font.

Output: ``items.jsonl`` (one line per item: id, chat messages whose image parts are paths relative to the file,
gold) and ``pages/*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

CJK_FONTS = ("/usr/share/fonts/opentype/ipaexfont-gothic/ipaexg.ttf",
             "/usr/share/fonts/opentype/ipafont-gothic/ipag.ttf",
             "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
PAGE_SIZE = (620, 820)          # width, height in pixels

EN_STORES = ["HARBOR LANE HARDWARE", "GREENBASKET GROCERY", "Maple & Pine Books", "Copperleaf Coffee"]
JA_STORES = ["ベーカリー こむぎ堂", "ミドリ薬局 中野駅前店", "らーめん 風見鶏", "文具の森 吉祥寺店"]
EN_GOODS = ["Box of screws", "Masking tape", "Oat milk 1L", "Sourdough loaf", "Notebook A5", "Espresso",
            "AA batteries (4)", "Garden gloves", "Apples 1kg", "Paperback novel"]
JA_GOODS = ["クロワッサン", "食パン 一斤", "目薬", "マスク 30枚", "醤油らーめん", "餃子", "ボールペン", "ノート B5",
            "付箋", "カフェラテ"]
EN_PEOPLE = ["Priya Raman", "Tom Okafor", "Greta Lund", "Daniel Moreau", "Aiko Brennan", "Samuel Osei"]
JA_PEOPLE = ["高橋 真理子", "山本 健一", "中村 悠", "佐藤 美咲", "伊藤 拓海", "小林 直樹"]
EN_COMPANIES = ["Northwind Robotics Inc.", "Bellfield Insurance Ltd", "Fjordline Shipping AS"]
JA_COMPANIES = ["株式会社ソラノ精機", "株式会社みなと物流", "あおば食品工業株式会社"]
EN_POSITIONS = ["Vice President of Engineering", "Chief Technology Officer", "Claims Team Lead",
                "Head of Customer Operations", "Chief Financial Officer", "Director of Sales", "Plant Manager"]
JA_POSITIONS = ["経理部長", "財務部長", "執行役員 東日本営業部長", "取締役 営業本部長", "製造本部長", "品質保証部長",
                "総務課長"]
PAYMENTS = {"cash": ("CASH", "現金"), "credit_card": ("VISA ****1234", "クレジットカード"),
            "e-money": ("E-MONEY", "電子マネー"), "qr_code": ("QR PAY", "QRコード決済")}
RECEIPT_PROMPT = ("Extract from the receipt one JSON object with exactly these keys: store (string, as printed), "
                  "date (YYYY-MM-DD), total (number, no currency sign or separators), currency (ISO 4217 code), "
                  "payment_method (one of cash, credit_card, e-money, qr_code). Answer with the JSON only.")
NOTICE_PROMPT = ("Extract every personnel change on these pages as JSON: {\"changes\": [...]} with one object per "
                 "change, in page order, with the fields name, company, old_position, new_position, "
                 "effective_date (YYYY-MM-DD). Answer with the JSON only.")


def _date(rng: np.random.Generator) -> tuple[int, int, int]:
    return 2024 + int(rng.integers(0, 2)), int(rng.integers(1, 13)), int(rng.integers(1, 29))


def _receipt(rng: np.random.Generator, lang: str, i: int) -> dict[str, Any]:
    ja = lang == "ja"
    store = str(rng.choice(JA_STORES if ja else EN_STORES))
    goods = rng.choice(JA_GOODS if ja else EN_GOODS, size=int(rng.integers(2, 5)), replace=False)
    lines = []
    for g in goods:
        qty = int(rng.integers(1, 4))
        unit = int(rng.integers(1, 30)) * 10 if ja else round(float(rng.integers(150, 1500)) / 100, 2)
        lines.append((str(g), qty, unit))
    total = sum(q * u for _, q, u in lines)
    total = int(total) if ja else round(total, 2)
    payment = str(rng.choice(list(PAYMENTS)))
    y, m, d = _date(rng)
    gold = {"store": store, "date": f"{y:04d}-{m:02d}-{d:02d}", "total": total, "currency": "JPY" if ja else "USD",
            "payment_method": payment}
    return {"id": f"receipt-{lang}-{i}", "kind": "receipt", "lang": lang, "lines": lines, "ymd": (y, m, d),
            "pages": 1, "gold": gold}


def _notice(rng: np.random.Generator, lang: str, i: int) -> dict[str, Any]:
    ja = lang == "ja"
    company = str(rng.choice(JA_COMPANIES if ja else EN_COMPANIES))
    people = rng.choice(JA_PEOPLE if ja else EN_PEOPLE, size=2, replace=False)
    changes = []
    for person in people:
        old, new = rng.choice(JA_POSITIONS if ja else EN_POSITIONS, size=2, replace=False)
        y, m, d = _date(rng)
        changes.append({"name": str(person), "company": company, "old_position": str(old), "new_position": str(new),
                        "effective_date": f"{y:04d}-{m:02d}-{d:02d}"})
    return {"id": f"notice-{lang}-{i}", "kind": "notice", "lang": lang, "pages": len(changes),
            "gold": {"changes": changes}}


def draw_documents(seed: int = 0) -> list[dict[str, Any]]:
    """The 8 documents (content and gold), drawn from one default_rng(seed): 2 receipts and 2 notices per
    language. No font needed."""
    rng = np.random.default_rng(seed)
    docs = []
    for lang in ("en", "ja"):
        docs += [_receipt(rng, lang, i) for i in range(2)]
        docs += [_notice(rng, lang, i) for i in range(2)]
    return docs


# ------------------------------------------------------------------------------------------------ rendering
def find_cjk_font(font: str | None = None) -> str | None:
    for path in (font, os.environ.get("HAYABUSA_CJK_FONT"), *CJK_FONTS):
        if path and os.path.isfile(path):
            return path
    return None


def _receipt_lines(doc: dict[str, Any]) -> list[str]:
    g, (y, m, d) = doc["gold"], doc["ymd"]
    if doc["lang"] == "ja":
        out = [g["store"], f"{y}年{m}月{d}日", "-" * 24]
        out += [f"{name} x{q}   ¥{q * u:,}" for name, q, u in doc["lines"]]
        return out + ["-" * 24, f"合計   ¥{g['total']:,}", f"お支払い: {PAYMENTS[g['payment_method']][1]}",
                      "ありがとうございました"]
    out = [g["store"], f"{m:02d}/{d:02d}/{y}", "-" * 28]
    out += [f"{name} x{q}   ${q * u:.2f}" for name, q, u in doc["lines"]]
    return out + ["-" * 28, f"TOTAL   ${g['total']:.2f}", f"PAID: {PAYMENTS[g['payment_method']][0]}",
                  "Thank you for shopping!"]


def _notice_lines(doc: dict[str, Any], change: dict[str, Any], page: int) -> list[str]:
    y, m, d = (int(x) for x in change["effective_date"].split("-"))
    if doc["lang"] == "ja":
        return [f"人事異動のお知らせ ({page + 1}/{doc['pages']})", change["company"], "",
                f"氏名: {change['name']}", f"新役職: {change['new_position']}", f"旧役職: {change['old_position']}",
                f"発令日: {y}年{m}月{d}日", "", "以上"]
    month = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
             "November", "December"][m - 1]
    return [f"Personnel announcement ({page + 1}/{doc['pages']})", change["company"], "",
            f"{change['name']}, until now {change['old_position']},", f"is appointed {change['new_position']}",
            f"effective {month} {d}, {y}.", "", "Human Resources"]


def render_page(lines: list[str], font_path: str) -> Any:
    """Black text on a white grayscale page (PAGE_SIZE), one line per entry."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("L", PAGE_SIZE, 255)
    draw = ImageDraw.Draw(page)
    title, body = ImageFont.truetype(font_path, 30), ImageFont.truetype(font_path, 22)
    y = 50
    for k, line in enumerate(lines):
        draw.text((40, y), line, fill=0, font=title if k == 0 else body)
        y += 48 if k == 0 else 36
    return page


def build(out_dir: str, seed: int = 0, font: str | None = None) -> list[dict[str, Any]]:
    """Render every page into out_dir/pages and write out_dir/items.jsonl. Returns the JSONL rows."""
    font_path = find_cjk_font(font)
    if font_path is None:
        raise SystemExit("no CJK font found: pass --font FILE.ttf or set HAYABUSA_CJK_FONT (Debian: apt-get install "
                         "fonts-ipaexfont-gothic).")
    os.makedirs(os.path.join(out_dir, "pages"), exist_ok=True)
    rows = []
    for doc in draw_documents(seed):
        if doc["kind"] == "receipt":
            pages = [_receipt_lines(doc)]
        else:
            pages = [_notice_lines(doc, c, p) for p, c in enumerate(doc["gold"]["changes"])]
        parts: list[dict[str, Any]] = []
        for p, lines in enumerate(pages):
            rel = f"pages/{doc['id']}-{p + 1}.png"
            render_page(lines, font_path).save(os.path.join(out_dir, rel), optimize=True)
            parts.append({"type": "image", "image": rel})
        parts.append({"type": "text", "text": RECEIPT_PROMPT if doc["kind"] == "receipt" else NOTICE_PROMPT})
        rows.append({"id": doc["id"], "messages": [{"role": "user", "content": parts}], "gold": doc["gold"]})
    with open(os.path.join(out_dir, "items.jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--font", default=None, help="a TrueType / OpenType font with Japanese glyphs")
    ns = p.parse_args(argv)
    rows = build(ns.out, ns.seed, ns.font)
    print(f"{len(rows)} items, {sum(len(r['messages'][0]['content']) - 1 for r in rows)} pages -> {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
