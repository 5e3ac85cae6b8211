"""WebShop-1k: WebShop's text environment on its 1,000-product catalog, search by embedded BM25.
The search index and spaCy are loaded lazily, when an env is made."""

from envs.base import ENVS
from envs.webshop.screenshot import WebShopScreenshotSpec
from envs.webshop.spec import WebShopSpec

ENVS.register("webshop")(WebShopSpec)
ENVS.register("webshop_screenshot")(WebShopScreenshotSpec)

__all__ = ["WebShopScreenshotSpec", "WebShopSpec"]
