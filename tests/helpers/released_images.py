"""The released picture preparation (ByteDance's Vidi, GitHub bytedance/vidi: `Vidi1.5_9B/vidi/dataset/img_utils.py`
and `Vidi_7B/model/img_utils.py`, the same in both, with the towers of `mm_vision/clip.py` and `mm_vision/siglip.py`)
written out literally from reading it: `process_images` and what it calls. The tests hold our preparation to it.

Imports neither dattn_export nor anything beyond PIL, torch and the tower's processor, so a process that must not
import the package (the pushed repo's usage) can use it."""

import torch
from PIL import Image


def with_output_size(processor):
    """The towers set this on their processor: CLIP `size["shortest_edge"]`, SigLIP `size["height"]`."""
    size = processor.size
    processor.output_size = size["shortest_edge"] if "shortest_edge" in size else size["height"]
    return processor


def select_best_resolution(original_size, possible_resolutions):
    original_width, original_height = original_size
    best_fit, max_effective_resolution, min_wasted_resolution = None, 0, float("inf")
    for width, height in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution
        if effective_resolution > max_effective_resolution or (
            effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution
        ):
            max_effective_resolution, min_wasted_resolution, best_fit = (
                effective_resolution,
                wasted_resolution,
                (
                    width,
                    height,
                ),
            )
    return best_fit


def divide_to_patches(image, patch_size):
    patches = []
    width, height = image.size
    for i in range(0, height, patch_size):
        for j in range(0, width, patch_size):
            patches.append(image.crop((j, i, j + patch_size, i + patch_size)))
    return patches


def process_anyres_image(image, processor, grid_pinpoints):
    best_resolution = select_best_resolution(image.size, grid_pinpoints)
    image_resized = image.resize(best_resolution, resample=Image.BICUBIC)
    patches = divide_to_patches(image_resized, processor.output_size)
    image_original_resize = image.resize((processor.output_size, processor.output_size), resample=Image.BICUBIC)
    image_patches = [image_original_resize] + patches
    image_patches = [processor.preprocess(p, return_tensors="pt")["pixel_values"][0] for p in image_patches]
    return torch.stack(image_patches, dim=0)


def expand2square(pil_img, background_color):
    width, height = pil_img.size
    if width == height:
        return pil_img
    elif width > height:
        result = Image.new(pil_img.mode, (width, width), background_color)
        result.paste(pil_img, (0, (width - height) // 2))
        return result
    else:
        result = Image.new(pil_img.mode, (height, height), background_color)
        result.paste(pil_img, ((height - width) // 2, 0))
        return result


def process_images(images, image_processor, model_cfg):
    """`model_cfg` needs mm_image_aspect_ratio and, for anyres, mm_image_grid_res (pixels: [columns x side, rows x
    side] per tiling)."""
    image_aspect_ratio = getattr(model_cfg, "mm_image_aspect_ratio", None)
    new_images = []
    if image_aspect_ratio == "pad":
        for image in images:
            image = expand2square(image, tuple(int(x * 255) for x in image_processor.image_mean))
            image = image_processor.preprocess(image, return_tensors="pt")["pixel_values"][0]
            new_images.append(image)
    elif image_aspect_ratio == "resize":
        for image in images:
            image = image.resize((image_processor.output_size, image_processor.output_size), resample=Image.BICUBIC)
            image = image_processor.preprocess(image, return_tensors="pt")["pixel_values"][0]
            new_images.append(image)
    elif image_aspect_ratio == "anyres":
        for image in images:
            new_images.append(process_anyres_image(image, image_processor, model_cfg.mm_image_grid_res))
    elif image_aspect_ratio == "crop":
        return image_processor(images, return_tensors="pt")["pixel_values"]
    else:
        raise NotImplementedError(f"Unsupported image aspect ratio: {image_aspect_ratio}")
    if all(x.shape == new_images[0].shape for x in new_images):
        new_images = torch.stack(new_images, dim=0)
    return new_images


def open_picture(path):
    """How the released dataset and inference open a picture: `Image.open(image_file).convert('RGB')`."""
    return Image.open(path).convert("RGB")
